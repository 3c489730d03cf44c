//! Baseline layouts (stub; being written).
