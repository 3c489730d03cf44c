//! Settings texts: what an optimizer (`Optimizer::settings`, its config's `Debug` text) and
//! the FSDP options record in a checkpoint and exchange between ranks, read as one
//! `path = value` pair per field ([`fields`]) and compared field by field ([`differences`];
//! [`changes`] writes them as text). The one reading of those texts: `ragged checkpoint info`
//! prints them, a load lists what a resumed run changed, and `fully_shard` names the first
//! setting on which ranks differ.

use std::collections::HashMap;

/// The settings an optimizer records (its config's `Debug` text, `Optimizer::settings`) as one
/// `path = value` pair per field, nested structs flattened into dotted paths
/// (`adam.roles.matrix.lr_scale = 1.0`): a one-line struct of twenty fields does not read.
/// Values that are not structs (numbers, enums, lists, tuples) stay as written; text that is
/// not a struct's `Debug` (an optimizer of the user's own may record anything) is `None`.
pub fn fields(text: &str) -> Option<Vec<(String, String)>> {
    let mut out = Vec::new();
    flatten_struct("", text.trim(), &mut out)?;
    Some(out)
}

/// Appends the fields of `Name { a: x, b: Inner { .. } }` under `prefix`; `None` when `text`
/// is not of that form.
fn flatten_struct(prefix: &str, text: &str, out: &mut Vec<(String, String)>) -> Option<()> {
    let open = text.find(" {")?;
    let name = &text[..open];
    if name.is_empty() || !name.chars().all(|c| c.is_alphanumeric() || c == '_') {
        return None;
    }
    let body = text[open + 2..].strip_suffix('}')?.trim();
    for field in split_top_level(body, ',')? {
        let (key, value) = field.split_once(": ")?;
        let path = if prefix.is_empty() {
            key.to_string()
        } else {
            format!("{prefix}.{key}")
        };
        if flatten_struct(&path, value, out).is_none() {
            out.push((path, value.to_string()));
        }
    }
    Some(())
}

/// `text` split at each `sep` outside brackets and string literals, each part trimmed and empty
/// parts dropped; `None` when the brackets or quotes do not balance.
fn split_top_level(text: &str, sep: char) -> Option<Vec<&str>> {
    let (mut parts, mut start, mut depth) = (Vec::new(), 0, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for (i, c) in text.char_indices() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth = depth.checked_sub(1)?,
            _ if c == sep && depth == 0 => {
                parts.push(text[start..i].trim());
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    if depth != 0 || in_string {
        return None;
    }
    parts.push(text[start..].trim());
    parts.retain(|p| !p.is_empty());
    Some(parts)
}

/// One setting that differs between two texts: its path, and its value in each (`None`
/// where that text has no such setting).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Difference {
    pub path: String,
    pub saved: Option<String>,
    pub now: Option<String>,
}

/// The settings of `now` that differ from `saved`, in `now`'s order, then those `now` lacks.
/// Texts that are not a struct's `Debug` (an optimizer of the user's own may record anything)
/// differ as a whole: one difference of path `""` when unequal.
pub fn differences(saved: &str, now: &str) -> Vec<Difference> {
    let (Some(old), Some(new)) = (fields(saved), fields(now)) else {
        let whole = Difference {
            path: String::new(),
            saved: Some(saved.to_string()),
            now: Some(now.to_string()),
        };
        return if saved == now {
            Vec::new()
        } else {
            vec![whole]
        };
    };
    let old_of: HashMap<&str, &str> = old.iter().map(|(p, v)| (p.as_str(), v.as_str())).collect();
    let new_of: HashMap<&str, &str> = new.iter().map(|(p, v)| (p.as_str(), v.as_str())).collect();
    let changed = new.iter().filter_map(|(path, value)| {
        let was = old_of.get(path.as_str()).copied();
        (was != Some(value.as_str())).then(|| Difference {
            path: path.clone(),
            saved: was.map(str::to_string),
            now: Some(value.clone()),
        })
    });
    let gone = old
        .iter()
        .filter(|(path, _)| !new_of.contains_key(path.as_str()))
        .map(|(path, value)| Difference {
            path: path.clone(),
            saved: Some(value.clone()),
            now: None,
        });
    changed.chain(gone).collect()
}

/// [`differences`] as text, `path: old → new`: values as written (`adamw.beta1: 0.9 → 0.5`), a
/// setting added since `saved` was written as `path: not recorded → new`,
/// one gone as `path: old → no such setting`, texts that are no struct's as `` `saved` →
/// `now` ``.
pub fn changes(saved: &str, now: &str) -> Vec<String> {
    let text = |d: Difference| match (d.path.as_str(), d.saved, d.now) {
        ("", Some(a), Some(b)) => format!("`{a}` → `{b}`"),
        (path, a, b) => format!(
            "{path}: {} → {}",
            a.as_deref().unwrap_or("not recorded"),
            b.as_deref().unwrap_or("no such setting")
        ),
    };
    differences(saved, now).into_iter().map(text).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    #[allow(dead_code)] // read through Debug only
    struct Inner {
        scale: f64,
        tag: Option<String>,
    }

    #[derive(Debug)]
    #[allow(dead_code)]
    struct Outer {
        lr: f64,
        betas: (f64, f64),
        inner: Inner,
        list: Vec<Inner>,
        unit: (),
    }

    #[test]
    fn a_config_debug_text_flattens_to_one_pair_per_field() {
        let config = Outer {
            lr: 1e-3,
            betas: (0.9, 0.95),
            inner: Inner {
                scale: 2.0,
                tag: Some("a, b: {\"c\"} }".into()),
            },
            list: vec![Inner {
                scale: 1.0,
                tag: None,
            }],
            unit: (),
        };
        let pairs = fields(&format!("{config:?}")).unwrap();
        let pairs: Vec<(&str, &str)> = pairs
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            pairs,
            [
                ("lr", "0.001"),
                ("betas", "(0.9, 0.95)"),
                ("inner.scale", "2.0"),
                ("inner.tag", r#"Some("a, b: {\"c\"} }")"#),
                ("list", "[Inner { scale: 1.0, tag: None }]"),
                ("unit", "()"),
            ]
        );
    }

    #[test]
    fn text_that_is_not_a_struct_is_none() {
        for text in [
            "",
            "lr=0.1",
            "Config { lr: 0.1",
            "Config { lr: (0.1 }",
            "Config { lr 0.1 }",
            "Config { s: \"open }",
            "a b { x: 1 }",
        ] {
            assert_eq!(fields(text), None, "{text:?}");
        }
        assert_eq!(fields("Empty {  }"), Some(vec![]));
    }

    #[test]
    fn changes_name_each_changed_added_and_gone_setting() {
        let saved = "MuonConfig { lr: 0.02, adamw: AdamWConfig { lr: 0.001, betas: (0.9, 0.999), \
                     weight_decay: Some(0.1) }, momentum: 0.95 }";
        let now = "MuonConfig { lr: 0.02, adamw: AdamWConfig { lr: 0.001, betas: (0.5, 0.999), \
                   weight_decay: Some(0.2) }, momentum: 0.5 }";
        assert_eq!(
            changes(saved, now),
            [
                "adamw.betas: (0.9, 0.999) → (0.5, 0.999)",
                "adamw.weight_decay: Some(0.1) → Some(0.2)",
                "momentum: 0.95 → 0.5"
            ]
        );
        assert!(changes(saved, saved).is_empty());
        // A setting added since the checkpoint was written: that one, not the whole text.
        let added = saved.replace("momentum: 0.95 }", "momentum: 0.95, flatten_min_dims: 4 }");
        assert_eq!(
            changes(saved, &added),
            ["flatten_min_dims: not recorded → 4"]
        );
        let other = "MuonConfig { lr: 0.03, nesterov: true }";
        assert_eq!(
            changes(saved, other),
            [
                "lr: 0.02 → 0.03",
                "nesterov: not recorded → true",
                "adamw.lr: 0.001 → no such setting",
                "adamw.betas: (0.9, 0.999) → no such setting",
                "adamw.weight_decay: Some(0.1) → no such setting",
                "momentum: 0.95 → no such setting"
            ]
        );
        // Text of a user's own that is no struct: compared whole.
        assert!(changes("lr=0.1", "lr=0.1").is_empty());
        assert_eq!(changes("lr=0.1", "lr=0.2"), ["`lr=0.1` → `lr=0.2`"]);
    }
}
