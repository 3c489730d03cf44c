//! The one way the `ragged` CLI writes to standard output ([`ragged::outln!`], [`print_stdout`]) and
//! shows a user's strings there ([`printable`]).
//!
//! `println!` panics when stdout fails (a full disk: `ragged … >/dev/full`); these return the
//! error instead, so the command exits 1 with `error: print: -: …` like every other refusal.
//! A reader that goes away (`ragged … | head`) ends the process quietly: `main` restores
//! SIGPIPE's default action.

pub use ragged::demo::print_stdout;

/// `s` with control characters, quotes and backslashes escaped as Rust writes them
/// (`str::escape_debug`): a name read from a user's file (a model, unit or tensor name, a
/// checkpoint's metadata) must not print a newline or run a terminal escape sequence.
pub fn printable(s: &str) -> String {
    s.escape_debug().to_string()
}

/// The settings an optimizer records (its config's `Debug` text, `Optimizer::settings`) as one
/// `path = value` pair per field, nested structs flattened into dotted paths
/// (`adam.roles.matrix.lr_scale = 1.0`): a one-line struct of twenty fields does not read.
/// Values that are not structs (numbers, enums, lists, tuples) stay as written; text that is
/// not a struct's `Debug` (an optimizer of the user's own may record anything) is `None`.
pub fn debug_fields(text: &str) -> Option<Vec<(String, String)>> {
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
        let pairs = debug_fields(&format!("{config:?}")).unwrap();
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
            assert_eq!(debug_fields(text), None, "{text:?}");
        }
        assert_eq!(debug_fields("Empty {  }"), Some(vec![]));
    }
}
