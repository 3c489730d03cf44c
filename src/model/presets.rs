//! Built-in model inventories computed from config values (stub; see issue 2).

use super::Inventory;

/// Names accepted by [`by_name`].
pub const NAMES: &[&str] = &[];

/// The preset called `name`, if any.
pub fn by_name(_name: &str) -> Option<Inventory> {
    None
}
