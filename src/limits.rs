//! Checks on numbers a user types: counts, rates and clocks, and sizes that must fit in this
//! machine's memory. The `ragged` CLI, the benches and the examples call these before they
//! allocate or divide, so bad input is an [`Error::BadInput`] saying why, never a panic, an
//! abort on a huge allocation, a wrapped integer or a NaN in a table.
//!
//! | check | refuses |
//! |---|---|
//! | [`positive_finite`] | `0`, negatives, `NaN`, `±∞` (rates, clocks, learning rates) |
//! | [`at_least`] | a count below its minimum (`--repeats 0`, a world of 0 ranks) |
//! | [`at_most`] | a count above its maximum (`--reps` that would run for days) |
//! | [`checked_product`] | a product of sizes that overflows `usize` |
//! | [`fits_in_memory`] | more bytes than `/proc/meminfo`'s `MemAvailable` |
//! | [`zeroed`] | an allocation the allocator refuses (`ulimit -v`), as an `Err`, not an abort |
//! | [`read_regular`], [`regular_file_size`] | a FIFO, device or folder where a file is read (a read that would block or never end), and a file past its kind's size |
//! | [`same_file`] | two path flags (an output and an input, two outputs) that name one file; [`folder_of`] is the folder a path names a file in |
//! | [`env_timeout`] | a timeout variable (`RAGGED_NCCL_TIMEOUT_S`, `RAGGED_MPI_TIMEOUT_S`) that is not a finite, non-negative number of seconds |

use std::path::Path;

use crate::{Error, Result};

/// `x` if it is finite and `> 0`, else `Err` naming `what` (a flag such as `--ghz`).
pub fn positive_finite(op: &'static str, what: &str, x: f64) -> Result<f64> {
    if x.is_finite() && x > 0.0 {
        return Ok(x);
    }
    Err(Error::BadInput {
        op,
        what: format!("{what} {x}"),
        reason: "must be a finite number greater than 0".into(),
    })
}

/// `n` if it is at least `min`, else `Err` naming `what`.
pub fn at_least(op: &'static str, what: &str, n: usize, min: usize) -> Result<usize> {
    if n >= min {
        return Ok(n);
    }
    Err(Error::BadInput {
        op,
        what: format!("{what} {n}"),
        reason: format!("must be at least {min}"),
    })
}

/// `n` if it is at most `max`, else `Err` naming `what` and `why` the bound exists.
pub fn at_most(op: &'static str, what: &str, n: usize, max: usize, why: &str) -> Result<usize> {
    if n <= max {
        return Ok(n);
    }
    Err(Error::BadInput {
        op,
        what: format!("{what} {n}"),
        reason: format!("must be at most {max} ({why})"),
    })
}

/// Each of `ranks` ranks' equal share of `total` (a batch's rows), or `Err` naming `what`
/// unless `total` is a positive multiple of `ranks`.
pub fn even_share(op: &'static str, what: &str, total: usize, ranks: usize) -> Result<usize> {
    if total > 0 && ranks > 0 && total % ranks == 0 {
        return Ok(total / ranks);
    }
    if ranks == 0 {
        return Err(Error::BadInput {
            op,
            what: "0 ranks".into(),
            reason: "a world needs at least one rank".into(),
        });
    }
    Err(Error::BadInput {
        op,
        what: format!("{what} {total}"),
        reason: format!("must split evenly over {ranks} ranks (a positive multiple of {ranks})"),
    })
}

/// The product of `factors`, or `Err` naming `what` when it overflows `usize`.
pub fn checked_product(op: &'static str, what: &str, factors: &[usize]) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| Error::BadInput {
            op,
            what: format!("{what} ({})", join(factors)),
            reason: "the size overflows this machine's address space".into(),
        })
}

/// `bytes` if they fit in the memory this machine has available now ([`available_memory`]),
/// else `Err` saying how much `what` needs and how much there is. Where the available memory
/// cannot be read (no `/proc/meminfo`), only `bytes` itself is returned: the allocation then
/// fails the usual way.
pub fn fits_in_memory(op: &'static str, what: &str, bytes: usize) -> Result<usize> {
    match available_memory() {
        Ok(free) if bytes as u64 > free => Err(Error::BadInput {
            op,
            what: what.to_string(),
            reason: format!(
                "needs {} but this machine has {} available (MemAvailable in /proc/meminfo)",
                human_bytes(bytes as u64),
                human_bytes(free)
            ),
        }),
        _ => Ok(bytes),
    }
}

/// `n` zeros, or `Err` naming `what` where the allocator refuses them: an address-space limit
/// (`ulimit -v`) or a cgroup can refuse what [`fits_in_memory`] saw available, and an
/// infallible allocation would then abort the process (`vec![0; n]` aborts, or panics when
/// `n` elements overflow the address space).
pub fn zeroed<T: bytemuck::Zeroable>(op: &'static str, what: &str, n: usize) -> Result<Vec<T>> {
    // Allocated zeroed (calloc), as `vec![0.0; n]` is: a large allocation's fresh pages are
    // zero already, so nothing is written before the caller writes.
    bytemuck::allocation::try_zeroed_vec(n).map_err(|()| {
        let size = std::mem::size_of::<T>();
        let bytes = n.checked_mul(size).filter(|&b| b <= isize::MAX as usize);
        Error::BadInput {
            op,
            what: what.to_string(),
            reason: match bytes {
                Some(b) => format!(
                    "cannot allocate {n} elements of {size} bytes: the allocator refused {}",
                    human_bytes(b as u64)
                ),
                None => format!(
                    "cannot allocate {n} elements of {size} bytes: more than one allocation can \
                     hold"
                ),
            },
        }
    })
}

/// `path`'s size if it is a regular file (or a link to one), else `Err`: reading a FIFO
/// blocks until a writer comes, and a device may never end.
pub fn regular_file_size(op: &'static str, path: &Path) -> Result<u64> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(op, path, e))?;
    if !meta.is_file() {
        return Err(Error::BadInput {
            op,
            what: path.display().to_string(),
            reason: "not a regular file (a folder, FIFO or device)".into(),
        });
    }
    Ok(meta.len())
}

/// The bytes of the regular file `path`, refused unread past `max` bytes (a JSON file that
/// large is damage, and must not exhaust memory before it is refused).
pub fn read_regular(op: &'static str, path: &Path, max: u64) -> Result<Vec<u8>> {
    let size = regular_file_size(op, path)?;
    if size > max {
        return Err(Error::BadInput {
            op,
            what: path.display().to_string(),
            reason: format!("{size} bytes, over the {max} a file of this kind may have (damaged?)"),
        });
    }
    std::fs::read(path).map_err(|e| Error::io(op, path, e))
}

/// The folder `path` is in (`.` for a bare file name).
pub fn folder_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Whether the paths `a` and `b` name the same file: both `-` (standard output), or the same
/// file once links and `.`/`..` are resolved (for a file not yet there, its folder's resolved
/// path and its name).
pub fn same_file(a: &Path, b: &Path) -> bool {
    let stdout = |p: &Path| p.as_os_str() == "-";
    if stdout(a) || stdout(b) {
        return stdout(a) && stdout(b);
    }
    resolved(a) == resolved(b)
}

/// `path` resolved as far as it exists: the file itself, else its folder joined with its name,
/// else as typed.
fn resolved(path: &Path) -> std::path::PathBuf {
    if let Ok(p) = std::fs::canonicalize(path) {
        return p;
    }
    match (std::fs::canonicalize(folder_of(path)), path.file_name()) {
        (Ok(dir), Some(name)) => dir.join(name),
        _ => path.to_path_buf(),
    }
}

/// `start + timeout`, or a deadline about a century away where the sum overflows `Instant`
/// (a timeout of `Duration::MAX` means "wait for ever", not a panic).
pub fn deadline(start: std::time::Instant, timeout: std::time::Duration) -> std::time::Instant {
    const CENTURY: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 86_400);
    start
        .checked_add(timeout)
        .or_else(|| start.checked_add(CENTURY))
        .unwrap_or(start)
}

/// The timeout a variable such as `RAGGED_MPI_TIMEOUT_S` sets: seconds, fractions allowed,
/// `default` when unset, `Ok(None)` for `0` (no limit). `Err` for a value that is not a
/// finite, non-negative number of seconds that a `Duration` can hold.
pub fn env_timeout(
    var: &'static str,
    default: std::time::Duration,
) -> Result<Option<std::time::Duration>> {
    parse_timeout(var, std::env::var(var).ok().as_deref(), default)
}

/// [`env_timeout`] of the variable's value (`None`: unset).
pub fn parse_timeout(
    var: &'static str,
    value: Option<&str>,
    default: std::time::Duration,
) -> Result<Option<std::time::Duration>> {
    let Some(v) = value else {
        return Ok(Some(default));
    };
    let bad = |reason: &str| Error::BadInput {
        op: var,
        what: v.to_string(),
        reason: reason.into(),
    };
    let secs: f64 = v
        .trim()
        .parse()
        .map_err(|_| bad("not a number of seconds"))?;
    if !secs.is_finite() || secs < 0.0 {
        return Err(bad("must be a finite, non-negative number of seconds"));
    }
    if secs == 0.0 {
        return Ok(None);
    }
    std::time::Duration::try_from_secs_f64(secs)
        .map(Some)
        .map_err(|_| bad("more seconds than a Duration holds"))
}

/// Bytes of memory available to new allocations: `MemAvailable` of `/proc/meminfo`.
pub fn available_memory() -> Result<u64> {
    const PATH: &str = "/proc/meminfo";
    let text = std::fs::read_to_string(PATH).map_err(|e| Error::io("available_memory", PATH, e))?;
    mem_available(&text)
}

/// `MemAvailable` in bytes from the text of `/proc/meminfo` (a line `MemAvailable:  N kB`).
pub fn mem_available(meminfo: &str) -> Result<u64> {
    let bad = |reason: &str| Error::BadInput {
        op: "mem_available",
        what: "/proc/meminfo".into(),
        reason: reason.into(),
    };
    let line = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .ok_or_else(|| bad("no MemAvailable line"))?;
    let mut words = line.split_whitespace();
    let kib: u64 = words
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| bad("MemAvailable is not a number"))?;
    if words.next() != Some("kB") {
        return Err(bad("MemAvailable is not in kB"));
    }
    kib.checked_mul(1024)
        .ok_or_else(|| bad("MemAvailable overflows u64 bytes"))
}

/// `12.3 GiB`-style text for a byte count.
fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = bytes as f64;
    let mut unit = 0;
    while x >= 1024.0 && unit + 1 < UNITS.len() {
        x /= 1024.0;
        unit += 1;
    }
    format!("{x:.1} {}", UNITS[unit])
}

fn join(factors: &[usize]) -> String {
    let parts: Vec<String> = factors.iter().map(usize::to_string).collect();
    parts.join(" × ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn a_timeout_variable_is_seconds_zero_turns_the_wait_off_and_nonsense_is_refused() {
        let (var, default) = ("RAGGED_TEST_TIMEOUT_S", Duration::from_secs(7));
        assert_eq!(parse_timeout(var, None, default).unwrap(), Some(default));
        assert_eq!(
            parse_timeout(var, Some(" 2.5 "), default).unwrap(),
            Some(Duration::from_millis(2500))
        );
        assert_eq!(parse_timeout(var, Some("0"), default).unwrap(), None);
        for bad in ["-1", "inf", "NaN", "soon", "1e20"] {
            let err = parse_timeout(var, Some(bad), default)
                .unwrap_err()
                .to_string();
            assert!(err.contains(var) && err.contains(bad), "{err}");
        }
        // A negative one is refused for being negative (not for its size).
        let err = parse_timeout(var, Some("-1"), default).unwrap_err();
        assert!(err.to_string().contains("non-negative"), "{err}");
        // The largest a Duration holds waits "for ever" without overflowing a deadline.
        let far = parse_timeout(var, Some("1e19"), default).unwrap().unwrap();
        assert!(deadline(Instant::now(), far) > Instant::now());
    }

    #[test]
    fn rates_must_be_finite_and_positive() {
        for bad in [0.0, -0.0, -1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let err = positive_finite("t", "--ghz", bad).unwrap_err().to_string();
            assert!(err.contains("--ghz") && err.contains("finite"), "{err}");
        }
        assert_eq!(positive_finite("t", "--ghz", 2.5).unwrap(), 2.5);
        assert_eq!(
            positive_finite("t", "--ghz", f64::MIN_POSITIVE).unwrap(),
            f64::MIN_POSITIVE
        );
    }

    #[test]
    fn counts_below_their_minimum_are_refused() {
        assert!(at_least("t", "--repeats", 0, 1).is_err());
        assert_eq!(at_least("t", "--repeats", 1, 1).unwrap(), 1);
    }

    #[test]
    fn shares_must_be_whole_and_positive() {
        assert_eq!(even_share("t", "--batch", 12, 3).unwrap(), 4);
        for (total, ranks) in [(8, 3), (0, 3)] {
            let err = even_share("t", "--batch", total, ranks)
                .unwrap_err()
                .to_string();
            assert!(err.contains(&format!("--batch {total}")), "{err}");
        }
        let err = even_share("t", "--batch", 8, 0).unwrap_err().to_string();
        assert!(err.contains("at least one rank"), "{err}");
    }

    #[test]
    fn counts_above_their_bound_are_refused() {
        assert_eq!(at_most("t", "--reps", 10, 10, "why").unwrap(), 10);
        let err = at_most("t", "--reps", 11, 10, "each is timed").unwrap_err();
        assert!(
            err.to_string().contains("at most 10 (each is timed)"),
            "{err}"
        );
    }

    #[test]
    fn products_that_overflow_are_refused_and_others_are_exact() {
        assert_eq!(checked_product("t", "x", &[3, 5, 7]).unwrap(), 105);
        assert_eq!(zeroed::<u16>("t", "x", 3).unwrap(), [0, 0, 0]);
        let refused = zeroed::<u64>("t", "x", usize::MAX / 8)
            .unwrap_err()
            .to_string();
        assert!(refused.contains("cannot allocate"), "{refused}");
        assert_eq!(checked_product("t", "x", &[]).unwrap(), 1);
        let err = checked_product("t", "buffer", &[usize::MAX / 2, 3]).unwrap_err();
        assert!(err.to_string().contains("overflows"), "{err}");
    }

    #[test]
    fn meminfo_parses_and_malformed_text_is_an_error() {
        let text = "MemTotal:       32000000 kB\nMemFree:  1 kB\nMemAvailable:   23000000 kB\n";
        assert_eq!(mem_available(text).unwrap(), 23_000_000 * 1024);
        for bad in [
            "",
            "MemAvailable: lots kB",
            "MemAvailable: 5 MB",
            "MemAvailable: 18446744073709551615 kB",
        ] {
            assert!(mem_available(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn more_than_the_available_memory_is_refused_saying_how_much() {
        let free = available_memory().expect("this test runs on Linux");
        assert!(fits_in_memory("t", "x", 1 << 20).is_ok());
        let too_much = usize::try_from(free).unwrap().saturating_add(1 << 30);
        let err = fits_in_memory("t", "the buffers", too_much)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("the buffers") && err.contains("available"),
            "{err}"
        );
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
