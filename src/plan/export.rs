//! Plans as files: JSON for other tools (`tools/check_plan.py` reads it) and SVG pictures.
//!
//! JSON format (one object):
//! `{"model", "world", "coll_align", "numel", "buffer_elems", "padding_frac", "units": [{"name",
//! "shard_size", "order", "padding", "tensors": [{"name", "shape", "dtype", "block", "offset",
//! "block_elems", "units_per_rank"}]}]}`. Offsets are element offsets in the unit's `V·S`
//! buffer; `units_per_rank` has `V` entries (a short tail block counts as one unit). The file is
//! streamed, since DeepSeek-V3 at `V = 1024` holds 46 million unit counts.

use std::fmt::Write as _;
use std::io::Write;

use super::{ModelPlan, Plan};
use crate::{Error, Result};

/// Writes `plan` as JSON to `out`.
pub fn write_json(plan: &ModelPlan, out: &mut impl Write) -> Result<()> {
    let io = |e| Error::io("write plan json", "<output>", e);
    write!(
        out,
        "{{\"model\":{},\"world\":{},\"coll_align\":{},\"numel\":{},\"buffer_elems\":{},\"padding_frac\":{},\"units\":[",
        serde_json::to_string(&plan.model)?,
        plan.world,
        plan.units.first().map_or(1, |u| u.coll_align),
        plan.numel(),
        plan.buffer_elems(),
        plan.padding_frac(),
    )
    .map_err(io)?;
    for (i, unit) in plan.units.iter().enumerate() {
        let sep = if i == 0 { "" } else { "," };
        writeln!(out, "{sep}").map_err(io)?;
        write_unit(unit, out)?;
    }
    writeln!(out, "\n]}}").map_err(io)
}

fn write_unit(unit: &Plan, out: &mut impl Write) -> Result<()> {
    let io = |e| Error::io("write plan json", "<output>", e);
    write!(
        out,
        "{{\"name\":{},\"shard_size\":{},\"order\":\"{}\",\"padding\":{},\"tensors\":[",
        serde_json::to_string(&unit.unit)?,
        unit.shard_size,
        unit.order,
        unit.padding()
    )
    .map_err(io)?;
    let mut line = String::new();
    for (i, p) in unit.placements.iter().enumerate() {
        line.clear();
        let sep = if i == 0 { "" } else { "," };
        let _ = write!(
            line,
            "{sep}\n {{\"name\":{},\"shape\":{:?},\"dtype\":\"{}\",\"block\":\"{}\",\"offset\":{},\"block_elems\":{},\"units_per_rank\":{:?}}}",
            serde_json::to_string(&p.name)?,
            p.shape,
            p.dtype,
            p.block,
            p.offset,
            p.block_elems,
            unit.units_per_rank(i)?,
        );
        out.write_all(line.as_bytes()).map_err(io)?;
    }
    write!(out, "]}}").map_err(io)
}

/// Draws one unit: one row per rank, each tensor a coloured span (hover for its name), padding
/// grey. Long rank lists are drawn with thinner rows.
pub fn svg(plan: &Plan) -> String {
    const WIDTH: f64 = 960.0;
    const LEFT: f64 = 70.0;
    let row_h = (640.0 / plan.world as f64).clamp(1.0, 18.0);
    let legend_rows = plan.placements.len().min(40);
    let height = 40.0 + row_h * plan.world as f64 + 16.0 * legend_rows as f64 + 20.0;
    let x_of = |elems: usize| LEFT + WIDTH * elems as f64 / plan.shard_size as f64;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height:.0}" font-family="monospace" font-size="11">"#,
        LEFT + WIDTH + 10.0
    );
    let _ = writeln!(
        s,
        r#"<text x="4" y="16">unit {} : V={} S={} padding {} elements ({:.3}%), order {}</text>"#,
        xml(&plan.unit),
        plan.world,
        plan.shard_size,
        plan.padding(),
        100.0 * plan.padding() as f64 / plan.numel() as f64,
        plan.order
    );
    for k in 0..plan.world {
        let y = 30.0 + row_h * k as f64;
        let _ = writeln!(
            s,
            r##"<rect x="{LEFT}" y="{y:.2}" width="{WIDTH}" height="{row_h:.2}" fill="#d0d0d0" stroke="none"/>"##
        );
        if row_h >= 9.0 {
            let _ = writeln!(
                s,
                r#"<text x="4" y="{:.2}">rank {k}</text>"#,
                y + row_h - 2.0
            );
        }
    }
    for (i, p) in plan.placements.iter().enumerate() {
        let colour = colour(i);
        let (lo, hi) = (p.offset, p.offset + p.numel());
        for k in lo / plan.shard_size..=(hi - 1) / plan.shard_size {
            let a = lo.max(k * plan.shard_size) - k * plan.shard_size;
            let b = hi.min((k + 1) * plan.shard_size) - k * plan.shard_size;
            let y = 30.0 + row_h * k as f64;
            let _ = writeln!(
                s,
                r#"<rect x="{:.2}" y="{y:.2}" width="{:.2}" height="{row_h:.2}" fill="{colour}" stroke="white" stroke-width="0.3"><title>{} [{}..{}) on rank {k}</title></rect>"#,
                x_of(a),
                (x_of(b) - x_of(a)).max(0.5),
                xml(&p.name),
                k * plan.shard_size + a - lo,
                k * plan.shard_size + b - lo,
            );
        }
    }
    let legend_y = 40.0 + row_h * plan.world as f64;
    for (i, p) in plan.placements.iter().take(legend_rows).enumerate() {
        let y = legend_y + 16.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<rect x="4" y="{y:.1}" width="12" height="12" fill="{}"/><text x="22" y="{:.1}">{} {:?} block {} ({} elems) at {}</text>"#,
            colour(i),
            y + 10.0,
            xml(&p.name),
            p.shape,
            p.block,
            p.block_elems,
            p.offset
        );
    }
    s.push_str("</svg>\n");
    s
}

/// A distinct colour per tensor index (golden-angle hue steps).
fn colour(i: usize) -> String {
    format!("hsl({:.0},65%,55%)", (i as f64 * 137.508) % 360.0)
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
