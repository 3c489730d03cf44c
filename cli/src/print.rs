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
