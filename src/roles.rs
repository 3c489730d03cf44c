//! Parameter roles: the one function of `(name, global shape)` that decides which update and
//! which state each parameter gets, and the per-role learning rate and weight decay (parameter
//! groups, as torch's `param_groups`).
//!
//! | role | Muon | 8-bit Adam | AdamW | `fully_shard` |
//! |---|---|---|---|---|
//! | [`Role::Matrix`] | Newton–Schulz update | 8-bit state (if the shape tiles) | AdamW | trained |
//! | [`Role::ElementWise`] | AdamW fallback | 8-bit state (if the shape tiles) | AdamW | trained |
//! | [`Role::Fp32State`] | AdamW fallback | `f32` state (bnb's `StableEmbedding`) | AdamW | trained |
//! | [`Role::Frozen`] | not stepped | not stepped | not stepped | own buffer, no gradient |
//!
//! The default rule ([`default_role`]) is right for Hugging Face / candle-transformers names:
//! hidden matrices (2-D, and batched `[E, m, n]` experts: any tensor of 3 or more dimensions,
//! so a conv filter too, which Muon flattens to `[out, in·kh·kw]`) are `Matrix`; embeddings
//! are `Fp32State`; output heads, norms, biases and every 1-D or 0-D parameter are
//! `ElementWise`.
//! It reproduces the two rules it replaces, Muon's `adamw_patterns` (`embed`, `lm_head`) and
//! 8-bit Adam's `fp32_patterns` (`embed`); `FsdpOptions::frozen` stays beside `Role::Frozen`
//! (either freezes a parameter).
//!
//! A [`RoleRule`] is `Copy` (optimizer configs are): name patterns are `&'static`, and a custom
//! rule is a function pointer (a closure that captures nothing).

use crate::{Error, Result};

/// What a parameter is, for the optimizer (see the module table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// A hidden matrix: Muon orthogonalizes it, 8-bit Adam quantizes its state.
    Matrix,
    /// Updated element-wise (Muon's AdamW fallback); 8-bit state when its shape tiles.
    ElementWise,
    /// Element-wise with `f32` optimizer state (8-bit Adam's fallback; AdamW under Muon).
    Fp32State,
    /// Not trained: gathered for compute, never given a gradient or stepped.
    Frozen,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Matrix => "matrix",
            Role::ElementWise => "element-wise",
            Role::Fp32State => "fp32-state",
            Role::Frozen => "frozen",
        })
    }
}

/// One role's hyperparameters, relative to the optimizer's own.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RoleSettings {
    /// Multiplies the optimizer's learning rate for this role (default 1). The weight decay
    /// `1 − lr·wd` uses the scaled rate too, so 0 leaves the role's parameters unchanged. The
    /// scaled rate and its decay are bounded as every rate is ([`RoleSettings::check_rates`]).
    pub lr_scale: f64,
    /// Replaces the optimizer's weight decay for this role (`None`, the default: the
    /// optimizer's own).
    pub weight_decay: Option<f64>,
}

impl RoleSettings {
    /// `Err(BadInput)` from `op` unless this role's rate `lr·lr_scale` and its decay (times
    /// its weight decay, or the optimizer's `weight_decay`) pass
    /// [`crate::optim::check_rates`]: what a step multiplies this role's tensors by, at the
    /// optimizer's rate `lr`. Each value passing [`RoleRule::validate`] alone does not make
    /// their product finite (`lr_scale = 1e300`).
    pub fn check_rates(
        &self,
        op: &'static str,
        role: Role,
        lr: f64,
        weight_decay: f64,
    ) -> Result<()> {
        let wd = self.weight_decay.unwrap_or(weight_decay);
        crate::optim::check_rates(op, &format!("{role} lr·lr_scale"), lr * self.lr_scale, wd)
    }
}

impl Default for RoleSettings {
    fn default() -> Self {
        RoleSettings {
            lr_scale: 1.0,
            weight_decay: None,
        }
    }
}

/// A custom role rule: `Some(role)` decides, `None` falls through to the patterns and the
/// default.
pub type RoleFn = fn(&str, &[usize]) -> Option<Role>;

/// The role of every parameter, and each role's hyperparameters. Decided in this order: the
/// custom function, then the first name pattern contained in the name, then [`default_role`].
/// The default: no custom function, no patterns, every role at the optimizer's rates.
#[derive(Clone, Copy, Default)]
pub struct RoleRule {
    /// A rule of its own, asked first.
    pub custom: Option<RoleFn>,
    /// `(substring, role)`: the first pattern the name contains gives the role.
    pub patterns: &'static [(&'static str, Role)],
    pub matrix: RoleSettings,
    pub element_wise: RoleSettings,
    pub fp32_state: RoleSettings,
}

/// Without the custom function's address, which differs from process to process (ranks
/// compare this text, [`crate::optim::Optimizer::settings`]; the roles it gives are compared
/// parameter by parameter).
impl std::fmt::Debug for RoleRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoleRule")
            .field("custom", &self.custom.map(|_| "fn"))
            .field("patterns", &self.patterns)
            .field("matrix", &self.matrix)
            .field("element_wise", &self.element_wise)
            .field("fp32_state", &self.fp32_state)
            .finish()
    }
}

impl PartialEq for RoleRule {
    fn eq(&self, other: &Self) -> bool {
        let custom = match (self.custom, other.custom) {
            (None, None) => true,
            (Some(a), Some(b)) => std::ptr::fn_addr_eq(a, b),
            _ => false,
        };
        custom
            && self.patterns == other.patterns
            && self.matrix == other.matrix
            && self.element_wise == other.element_wise
            && self.fp32_state == other.fp32_state
    }
}

impl RoleRule {
    /// The default rule with name patterns asked first (the old `adamw_patterns` /
    /// `fp32_patterns` lists: e.g. `&[("embed", Role::Fp32State)]`).
    pub fn with_patterns(patterns: &'static [(&'static str, Role)]) -> Self {
        RoleRule {
            patterns,
            ..RoleRule::default()
        }
    }

    /// The default rule with `custom` asked first.
    pub fn with_fn(custom: RoleFn) -> Self {
        RoleRule {
            custom: Some(custom),
            ..RoleRule::default()
        }
    }

    /// The role of a parameter of this name and global shape.
    pub fn role_of(&self, name: &str, shape: &[usize]) -> Role {
        if let Some(role) = self.custom.and_then(|f| f(name, shape)) {
            return role;
        }
        self.patterns
            .iter()
            .find(|(p, _)| name.contains(p))
            .map_or_else(|| default_role(name, shape), |&(_, role)| role)
    }

    /// The hyperparameters of `role` (`None` for [`Role::Frozen`], which is not stepped).
    pub fn settings(&self, role: Role) -> Option<RoleSettings> {
        match role {
            Role::Matrix => Some(self.matrix),
            Role::ElementWise => Some(self.element_wise),
            Role::Fp32State => Some(self.fp32_state),
            Role::Frozen => None,
        }
    }

    /// The roles a step updates, with their settings.
    fn stepped(&self) -> impl Iterator<Item = (Role, RoleSettings)> + '_ {
        let roles = [Role::Matrix, Role::ElementWise, Role::Fp32State];
        roles
            .into_iter()
            .filter_map(|r| Some((r, self.settings(r)?)))
    }

    /// `Err` unless every role's `lr_scale` and `weight_decay` are finite and non-negative.
    pub fn validate(&self) -> Result<()> {
        for (role, s) in self.stepped() {
            let wd = s.weight_decay.unwrap_or(0.0);
            for (what, v) in [("lr_scale", s.lr_scale), ("weight_decay", wd)] {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(Error::BadInput {
                        op: "RoleRule::validate",
                        what: format!("{role} {what} = {v:?}"),
                        reason: "must be finite and non-negative".into(),
                    });
                }
            }
        }
        Ok(())
    }

    /// [`RoleSettings::check_rates`] for every stepped role at the optimizer's `lr` and
    /// `weight_decay`; call it after [`RoleRule::validate`] (which names a bad value alone).
    pub fn check_rates(&self, op: &'static str, lr: f64, weight_decay: f64) -> Result<()> {
        self.stepped()
            .try_for_each(|(role, s)| s.check_rates(op, role, lr, weight_decay))
    }
}

/// Name segments of embeddings (any segment containing `embed` is one too).
const EMBEDDINGS: [&str; 2] = ["wte", "wpe"];

/// Name segments of output heads (`output` only as the first segment, Meta Llama's
/// `output.weight`: BERT's `attention.output.dense` is a hidden matrix).
const HEADS: [&str; 3] = ["lm_head", "head", "classifier"];

/// The default role: fewer than two dimensions → `ElementWise`; an embedding (a name segment
/// containing `embed`, or `wte`, `wpe`) → `Fp32State`; an output head (`lm_head`, `head`,
/// `classifier`, a leading `output`) or a norm (a segment containing `norm` or starting with
/// `ln`) → `ElementWise`; every other matrix → `Matrix`.
pub fn default_role(name: &str, shape: &[usize]) -> Role {
    if shape.len() < 2 {
        return Role::ElementWise;
    }
    let mut segments = name.split('.');
    let first = segments.clone().next().unwrap_or("");
    if segments
        .clone()
        .any(|s| s.contains("embed") || EMBEDDINGS.contains(&s))
    {
        return Role::Fp32State;
    }
    let head = first == "output" || segments.clone().any(|s| HEADS.contains(&s));
    if head || segments.any(|s| s.contains("norm") || s.starts_with("ln")) {
        return Role::ElementWise;
    }
    Role::Matrix
}
