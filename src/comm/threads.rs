//! Thread-rank backend (being written).
