//! The one way the `ragged` CLI writes to standard output ([`outln!`], [`print_stdout`]) and
//! shows a user's strings there ([`printable`]).
//!
//! `println!` panics when stdout fails (a full disk: `ragged … >/dev/full`); these return the
//! error instead, so the command exits 1 with `error: print: -: …` like every other refusal.
//! A reader that goes away (`ragged … | head`) ends the process quietly: `main` restores
//! SIGPIPE's default action.

use std::io::Write;

use ragged::{Error, Result};

/// `println!` that returns `ragged::Result<()>` instead of panicking when stdout fails.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::print::print_stdout(&format!("{}\n", format_args!($($arg)*)))
    };
}

/// Writes `text` to standard output and flushes it (stdout is line-buffered: an unflushed
/// tail would be written at exit, where its error could no longer be reported). A closed pipe
/// is not an error (where SIGPIPE is ignored and the write returns it instead).
pub fn print_stdout(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(Error::io("print", "-", e)),
        _ => Ok(()),
    }
}

/// `s` with control characters, quotes and backslashes escaped as Rust writes them
/// (`str::escape_debug`): a name read from a user's file (a model, unit or tensor name, a
/// checkpoint's metadata) must not print a newline or run a terminal escape sequence.
pub fn printable(s: &str) -> String {
    s.escape_debug().to_string()
}
