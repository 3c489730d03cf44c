//! Checks on flags shared by the subcommands, beside `ragged::limits`' checks on counts: a
//! number within a stated range, and two path flags that name one file.

use std::path::{Path, PathBuf};

use ragged::{Error, Result};

/// `x` if it is finite and within `min..=max`, else `Err` naming `flag`, the value typed and
/// the range (in `unit`). A value past the range is a typo or a unit mistake, and would
/// otherwise overflow to infinity or print nonsense once scaled (`1e300` GB/s in B/s).
pub fn finite_within(
    op: &'static str,
    flag: &str,
    x: f64,
    (min, max): (f64, f64),
    unit: &str,
) -> Result<f64> {
    if x.is_finite() && (min..=max).contains(&x) {
        return Ok(x);
    }
    Err(Error::BadInput {
        op,
        what: format!("{flag} {}", short(x)),
        reason: format!("must be a finite number from {min} to {max} {unit}"),
    })
}

/// `x` as typed, near enough: `1e300`, not its 301 digits (`Display` never writes an exponent).
fn short(x: f64) -> String {
    let plain = (1e-4..1e16).contains(&x.abs()) || x == 0.0 || !x.is_finite();
    if plain {
        x.to_string()
    } else {
        format!("{x:e}")
    }
}

/// Whether the path flags `a` and `b` name the same file: both `-` (standard output), or the
/// same file once links and `.`/`..` are resolved (for a file not yet there, its folder's
/// resolved path and its name).
pub fn same_file(a: &Path, b: &Path) -> bool {
    let stdout = |p: &Path| p.as_os_str() == "-";
    if stdout(a) || stdout(b) {
        return stdout(a) && stdout(b);
    }
    resolved(a) == resolved(b)
}

/// `path` resolved as far as it exists: the file itself, else its folder joined with its name,
/// else as typed.
fn resolved(path: &Path) -> PathBuf {
    if let Ok(p) = std::fs::canonicalize(path) {
        return p;
    }
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match (std::fs::canonicalize(folder), path.file_name()) {
        (Ok(dir), Some(name)) => dir.join(name),
        _ => path.to_path_buf(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finite_within_names_the_flag_and_the_range() {
        assert_eq!(
            finite_within("t", "--x", 2.0, (1.0, 3.0), "s").unwrap(),
            2.0
        );
        let cases = [
            (0.5, "--x 0.5"),
            (-4.0, "--x -4"),
            (f64::NAN, "--x NaN"),
            (f64::INFINITY, "--x inf"),
            (1e300, "--x 1e300"),
            (1e-300, "--x 1e-300"),
        ];
        for (bad, typed) in cases {
            let err = finite_within("t", "--x", bad, (1.0, 3.0), "s").unwrap_err();
            let text = err.to_string();
            assert!(text.contains(&format!("{typed}: ")), "{text}");
            assert!(text.contains("from 1 to 3 s"), "{text}");
        }
    }

    #[test]
    fn same_file_sees_through_spelling_and_links() {
        let dir = std::env::temp_dir().join(format!("ragged-same-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("a.json");
        std::fs::write(&file, "{}").unwrap();
        let link = dir.join("link.json");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert!(same_file(&file, &link));
        assert!(same_file(&file, &dir.join(".").join("a.json")));
        // Not there yet: the same folder and name.
        assert!(same_file(&dir.join("new.svg"), &dir.join("./new.svg")));
        assert!(!same_file(&dir.join("new.svg"), &file));
        assert!(same_file(Path::new("-"), Path::new("-")));
        assert!(!same_file(Path::new("-"), &file));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
