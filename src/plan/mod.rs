//! The layout planner (being written).

pub mod baselines;
