//! RaggedShard (stub; being written).
