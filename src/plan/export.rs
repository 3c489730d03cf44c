//! Plans as files: JSON for other tools (`tools/check_plan.py` reads it) and SVG pictures.
//!
//! JSON format (one object):
//! `{"model", "world", "coll_align", "numel", "buffer_elems", "padding_frac", "units": [{"name",
//! "shard_size", "order", "padding", "tensors": [{"name", "shape", "dtype", "block", "offset",
//! "block_elems", "units_per_rank"}]}]}`. Offsets are element offsets in the unit's `V·S`
//! buffer; `units_per_rank` has `V` entries (a short tail block counts as one unit). The file is
//! streamed, since DeepSeek-V3 at `V = 1024` holds 46 million unit counts.
//!
//! Multi-buffer JSON ([`write_multi_json`], what `ragged plan --json` writes; the `"buffers"`
//! form of `tools/check_plan.py`): `{"model", "world", "coll_align", "layers_per_unit", "numel",
//! "buffer_elems", "padding_frac", "floor_padding_frac", "units": [{"name", "k",
//! "floor_shard_sum", "single_shard_size", "buffers": [{"name", "shard_size", "order",
//! "padding", "tensors": [{"name", "shape", "dtype", "block", "offset", "block_elems",
//! "unit_runs"}]}]}]}`. Offsets are relative to the tensor's buffer. `unit_runs` is the
//! per-rank unit count run-length encoded, `[[first_rank, ranks, units], ...]` over the ranks
//! the tensor touches (ranks not listed hold none): at most three runs per tensor, since every
//! rank strictly between the first and the last holds `S / block` units. With `full_units`,
//! each tensor also gets the `V`-entry `units_per_rank` list.

use std::fmt::Write as _;
use std::io::Write;

use super::multi_model::{MultiModelPlan, MultiPlan};
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

/// Writes a multi-buffer plan as JSON to `out` (format in the module doc).
pub fn write_multi_json(
    plan: &MultiModelPlan,
    full_units: bool,
    out: &mut impl Write,
) -> Result<()> {
    let io = |e| Error::io("write plan json", "<output>", e);
    let coll = plan.units.first().map_or(1, |u| u.single.coll_align);
    write!(
        out,
        "{{\"model\":{},\"world\":{},\"coll_align\":{coll},\"layers_per_unit\":{},\"numel\":{},\"buffer_elems\":{},\"padding_frac\":{},\"floor_padding_frac\":{},\"units\":[",
        serde_json::to_string(&plan.model)?,
        plan.world,
        plan.layers_per_unit,
        plan.numel(),
        plan.buffer_elems(),
        plan.padding_frac(),
        plan.floor_padding_frac(),
    )
    .map_err(io)?;
    for (i, unit) in plan.units.iter().enumerate() {
        let sep = if i == 0 { "" } else { "," };
        writeln!(out, "{sep}").map_err(io)?;
        write_multi_unit(unit, full_units, out)?;
    }
    writeln!(out, "\n]}}").map_err(io)
}

fn write_multi_unit(unit: &MultiPlan, full_units: bool, out: &mut impl Write) -> Result<()> {
    let io = |e| Error::io("write plan json", "<output>", e);
    write!(
        out,
        "{{\"name\":{},\"k\":{},\"floor_shard_sum\":{},\"single_shard_size\":{},\"buffers\":[",
        serde_json::to_string(&unit.unit)?,
        unit.k(),
        unit.floor_shard_sum,
        unit.single.shard_size,
    )
    .map_err(io)?;
    let mut line = String::new();
    for (b, buf) in unit.buffers.iter().enumerate() {
        let sep = if b == 0 { "" } else { "," };
        write!(
            out,
            "{sep}\n{{\"name\":{},\"shard_size\":{},\"order\":\"{}\",\"padding\":{},\"tensors\":[",
            serde_json::to_string(&buf.unit)?,
            buf.shard_size,
            buf.order,
            buf.padding()
        )
        .map_err(io)?;
        for (i, p) in buf.placements.iter().enumerate() {
            line.clear();
            let sep = if i == 0 { "" } else { "," };
            let _ = write!(
                line,
                "{sep}\n {{\"name\":{},\"shape\":{:?},\"dtype\":\"{}\",\"block\":\"{}\",\"offset\":{},\"block_elems\":{},\"unit_runs\":{:?}",
                serde_json::to_string(&p.name)?,
                p.shape,
                p.dtype,
                p.block,
                p.offset,
                p.block_elems,
                unit_runs(buf, i)?,
            );
            if full_units {
                let _ = write!(line, ",\"units_per_rank\":{:?}", buf.units_per_rank(i)?);
            }
            line.push('}');
            out.write_all(line.as_bytes()).map_err(io)?;
        }
        write!(out, "]}}").map_err(io)?;
    }
    write!(out, "]}}").map_err(io)
}

/// The units of tensor `i` of `plan` per rank as runs `[first_rank, ranks, units]`, in O(1):
/// the tensor touches ranks `first..=last`; the ones strictly between hold a whole shard each.
pub fn unit_runs(plan: &Plan, i: usize) -> Result<Vec<[usize; 3]>> {
    let p = plan.placements.get(i).ok_or_else(|| Error::BadInput {
        op: "unit_runs",
        what: format!("tensor {i}"),
        reason: format!("unit {} has {} tensors", plan.unit, plan.placements.len()),
    })?;
    let (s, g) = (plan.shard_size, p.block_elems);
    let end = p
        .offset
        .checked_add(p.numel())
        .filter(|&e| e <= plan.buffer_elems());
    let Some(end) = end.filter(|_| s > 0 && g > 0) else {
        return Err(Error::Infeasible {
            op: "unit_runs",
            reason: format!("tensor {} does not lie inside its buffer", p.name),
        });
    };
    let (first, last) = (p.offset / s, (end - 1) / s);
    let held = |k: usize| end.min((k + 1) * s) - p.offset.max(k * s);
    // A short tail block counts as one unit (it ends the tensor, on the last rank).
    let units = |k: usize| {
        let h = held(k);
        if k == last {
            h.div_ceil(g)
        } else {
            h / g
        }
    };
    let mut runs = vec![[first, 1, units(first)]];
    if last > first + 1 {
        runs.push([first + 1, last - first - 1, s / g]);
    }
    if last > first {
        runs.push([last, 1, units(last)]);
    }
    Ok(runs)
}

/// Draws every buffer of a multi-buffer unit, one [`svg`] picture under the other.
pub fn svg_multi(unit: &MultiPlan) -> String {
    let pictures: Vec<String> = unit.buffers.iter().map(svg).collect();
    let height_of = |p: &str| -> f64 {
        p.split("height=\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .and_then(|h| h.parse().ok())
            .unwrap_or(0.0)
    };
    let total: f64 = pictures.iter().map(|p| height_of(p) + 10.0).sum();
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="1040" height="{total:.0}" font-family="monospace" font-size="11">"#
    );
    let mut y = 0.0;
    for p in &pictures {
        // A nested <svg> is placed by x/y attributes on its root element.
        let _ = writeln!(
            s,
            "{}",
            p.trim_end()
                .replacen("<svg ", &format!("<svg y=\"{y:.0}\" "), 1)
        );
        y += height_of(p) + 10.0;
    }
    s.push_str("</svg>\n");
    s
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
    // Control characters other than tab and newline are not allowed in XML 1.0 at all, even
    // as references: shown as U+FFFD.
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            c if c.is_control() && c != '\t' && c != '\n' => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}
