//! The one error type of ragged. Every public function returns `Result<T>`.
//!
//! Variants name the operation and carry the offending values, so a message can be read
//! without the source (`BlockDoesNotFit { op, block, shape, reason }`). One-off messages use
//! [`bail!`](crate::bail); [`Context`] adds a line of context to any error.

use std::fmt;

/// Errors returned by ragged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An atomic block cannot tile a tensor shape (zero sizes, a tile wider than a row, ...).
    #[error("{op}: block {block} does not fit shape {shape:?}: {reason}")]
    BlockDoesNotFit {
        op: &'static str,
        block: String,
        shape: Vec<usize>,
        reason: String,
    },

    /// A tensor shape is unusable (a zero dimension, an element count that overflows).
    #[error("{op}: invalid shape {shape:?}: {reason}")]
    InvalidShape {
        op: &'static str,
        shape: Vec<usize>,
        reason: String,
    },

    /// A sharding description is inconsistent (unit counts that do not add up, bad prefix dims).
    #[error("{op}: invalid sharding: {reason}")]
    InvalidShard { op: &'static str, reason: String },

    /// Two objects disagree on the number of ranks.
    #[error("{op}: world size mismatch: expected {expected}, got {got}")]
    WorldSizeMismatch {
        op: &'static str,
        expected: usize,
        got: usize,
    },

    /// A block would straddle two ranks: the layout is invalid.
    #[error("{op}: tensor {tensor} has a block cut at offset {offset} (block {block} elements)")]
    BlockSplit {
        op: &'static str,
        tensor: String,
        block: usize,
        offset: usize,
    },

    /// The planner found no layout (only possible with an explicit shard-size cap).
    #[error("{op}: no feasible layout: {reason}")]
    Infeasible { op: &'static str, reason: String },

    /// A collective failed: a rank left or panicked, the ranks disagreed, or it timed out.
    #[error("{op} on rank {rank}: {reason}")]
    Comm {
        op: &'static str,
        rank: usize,
        reason: String,
    },

    /// An error from candle (tensor library), with the operation that hit it. The message
    /// leaves out the backtraces candle attaches when `RUST_BACKTRACE` is set (hundreds of lines
    /// inside a one-line error); [`std::error::Error::source`] still holds them.
    #[error("{op}: candle: {}", candle_message(source))]
    Candle {
        op: &'static str,
        #[source]
        source: candle_core::Error,
    },

    /// A model inventory or plan file is malformed.
    #[error("{op}: bad input {what}: {reason}")]
    BadInput {
        op: &'static str,
        what: String,
        reason: String,
    },

    /// File system error, with the path involved.
    #[error("{op}: {path}: {source}")]
    Io {
        op: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },

    /// A checkpoint cannot be written or read: the file (or folder) and what is wrong with it.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: String, reason: String },

    /// JSON (de)serialization error.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),

    /// The GPU backend cannot be used here: the crate was built without the `cuda` feature, the
    /// CUDA driver, NVRTC or cuBLAS library cannot be loaded, or there is no such device.
    #[error("{op}: CUDA unavailable: {reason}")]
    CudaUnavailable { op: &'static str, reason: String },

    /// A CUDA driver, NVRTC or cuBLAS call failed, with the operation that made it.
    #[error("{op}: CUDA: {reason}")]
    Cuda { op: &'static str, reason: String },

    /// A loss or gradient is NaN or infinite (detected on every rank alike, before a step).
    #[error("{op}: non-finite values: {what}")]
    NonFinite { op: &'static str, what: String },

    /// A free-form message, from [`bail!`](crate::bail).
    #[error("{0}")]
    Msg(String),

    /// An error with one line of context prepended.
    #[error("{context}: {inner}")]
    Context {
        context: String,
        #[source]
        inner: Box<Error>,
    },
}

/// Shorthand used throughout the crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Returns early with an [`Error::Msg`] built like `format!`.
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::Error::Msg(format!($($arg)*)))
    };
}

mod sealed {
    pub trait Sealed {}
    impl<T> Sealed for crate::Result<T> {}
}

/// Adds context to a `Result` (sealed: implemented only for [`Result`]).
pub trait Context<T>: sealed::Sealed {
    /// Prepends `context` to the error message.
    fn context(self, context: impl fmt::Display) -> Result<T>;
    /// Like [`Context::context`], computing the message only on error.
    fn with_context<C: fmt::Display, F: FnOnce() -> C>(self, f: F) -> Result<T>;
}

impl<T> Context<T> for Result<T> {
    fn context(self, context: impl fmt::Display) -> Result<T> {
        self.map_err(|e| Error::Context {
            context: context.to_string(),
            inner: Box::new(e),
        })
    }

    fn with_context<C: fmt::Display, F: FnOnce() -> C>(self, f: F) -> Result<T> {
        self.map_err(|e| Error::Context {
            context: f().to_string(),
            inner: Box::new(e),
        })
    }
}

/// The text of a panic payload (`panic!` with a literal or a formatted message).
pub(crate) fn panic_text(payload: &(dyn std::any::Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "(no message)"
    }
}

/// A candle error's message without the backtraces `candle_core::Error::bt` wraps around it
/// (anywhere in a chain of contexts and paths).
fn candle_message(error: &candle_core::Error) -> String {
    use candle_core::Error as E;
    match error {
        E::WithBacktrace { inner, .. } => candle_message(inner),
        E::Context { inner, context } => format!("{context}\n{}", candle_message(inner)),
        E::WithPath { inner, path } => format!("path: {path:?} {}", candle_message(inner)),
        other => other.to_string(),
    }
}

/// `?` on candle results inside ragged code and user code returning [`Result`]. Library code
/// names the operation instead (`map_err(dbuffer::candle("op"))`); this names it "candle".
impl From<candle_core::Error> for Error {
    fn from(source: candle_core::Error) -> Self {
        Error::Candle {
            op: "candle",
            source,
        }
    }
}

impl Error {
    /// Wraps an I/O error with the operation and path.
    pub fn io(op: &'static str, path: impl AsRef<std::path::Path>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.as_ref().display().to_string(),
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under `RUST_BACKTRACE=1` candle wraps each error in a backtrace; ragged's message keeps
    /// candle's words and contexts and drops the frames.
    #[test]
    fn a_candle_error_reads_without_its_backtrace() {
        let traced = |e: candle_core::Error| candle_core::Error::WithBacktrace {
            inner: Box::new(e),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        };
        let inner = traced(candle_core::Error::Msg("shape mismatch".into()));
        let chained = traced(inner.context("stage 1").with_path("/tmp/w.safetensors"));
        assert!(
            chained.to_string().lines().count() > 3,
            "the test needs real frames"
        );
        let message = Error::Candle {
            op: "forward",
            source: chained,
        }
        .to_string();
        assert_eq!(
            message,
            "forward: candle: path: \"/tmp/w.safetensors\" stage 1\nshape mismatch"
        );
    }
}
