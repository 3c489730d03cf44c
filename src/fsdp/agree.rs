//! Ranks agree or fail: before anything is allocated, every rank fingerprints what it was
//! given (parameter names and their order, shapes, the plan, the initial values, the optimizer
//! and its learning rate, each parameter's role) and the fingerprints are exchanged once, with
//! the optimizer's settings ([`crate::optim::Optimizer::settings`]) and the `FsdpOptions` as
//! text, compared field by field ([`crate::settings::differences`]). Disagreeing ranks
//! (a parameter list built from a `HashMap` in another order, another seed, another model,
//! another `--weight-decay` from a per-rank launcher script) all get the same `Err`, naming
//! what differs and which ranks, instead of training on scrambled parameters.

use std::hash::Hasher;

use candle_core::{DType, Tensor};

use crate::comm::{all_gather_bytes, Buf, BufMut, Communicator};
use crate::dbuffer::candle;
use crate::optim::LocalShard;
use crate::roles::Role;
use crate::settings::differences;
use crate::{Error, Result};

/// FNV-1a, 64 bits: small, stable across processes and platforms (unlike `DefaultHasher`'s
/// unspecified algorithm), enough to tell inputs apart.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// What the fingerprints cover, in exchange order.
const ASPECTS: [&str; N] = [
    "parameter names and order",
    "parameter shapes",
    "the plan",
    "initial values",
    "the optimizer or its learning rate",
    "the parameters' roles",
];

/// How many fingerprints a rank sends.
const N: usize = 6;

/// The optimizer as the ranks compare it (a rank started with another `--lr` would train
/// another model without a word).
pub(crate) struct OptimizerId<'a> {
    pub name: &'a str,
    pub lr: Option<f64>,
    /// [`crate::optim::Optimizer::settings`].
    pub settings: String,
    /// Every parameter's role, in the order of the parameters.
    pub roles: Vec<Role>,
    /// The `FsdpOptions` (`Debug` text): ranks with another `reshard_after_forward`, `overlap`
    /// or precision would call other collectives mid-step, and another `non_finite` policy or
    /// `recompute` would make them part silently.
    pub options: String,
}

/// The fingerprints of one rank's input, and the first trained parameter element that is not
/// finite as an `f32` (read in the same pass), as `name: element i is v`.
fn fingerprints(
    params: &[(String, Tensor)],
    trained: &[bool],
    shards: &[&LocalShard],
    optimizer: &OptimizerId<'_>,
) -> Result<([u64; N], Option<String>)> {
    let mut not_finite = None;
    let mut h: [Fnv; N] = std::array::from_fn(|_| Fnv::default());
    h[4].write(optimizer.name.as_bytes());
    h[4].write_u64(optimizer.lr.map_or(u64::MAX, f64::to_bits));
    for role in &optimizer.roles {
        h[5].write(format!("{role:?}").as_bytes());
        h[5].write_u8(0);
    }
    for ((name, t), &trained) in params.iter().zip(trained) {
        h[0].write(name.as_bytes());
        h[0].write_u8(0);
        h[1].write_usize(t.rank());
        t.dims().iter().for_each(|&d| h[1].write_usize(d));
        let values = t
            .flatten_all()
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(candle("fully_shard: fingerprint"))?;
        values.iter().for_each(|v| h[3].write_u32(v.to_bits()));
        let bad = values.iter().position(|v| !v.is_finite());
        if let (None, true, Some(i)) = (&not_finite, trained, bad) {
            not_finite = Some(format!("{name}: element {i} is {}", values[i]));
        }
    }
    for shard in shards {
        h[2].write_usize(shard.len);
        for meta in &shard.params {
            h[2].write(meta.name.as_bytes());
            for hold in &meta.holdings {
                h[2].write_usize(hold.rank);
                h[2].write_usize(hold.range.start);
                h[2].write_usize(hold.range.end);
            }
        }
    }
    Ok((h.map(|h| h.finish()), not_finite))
}

/// Exchanges the fingerprints (one all-gather) and returns the same `Err` on every rank if any
/// rank's differ from rank 0's, or else if a parameter marked `trained` has an initial value
/// that is NaN or infinite as an `f32` (as `load_safetensors` refuses one).
pub(crate) fn check_ranks_agree(
    comm: &dyn Communicator,
    params: &[(String, Tensor)],
    trained: &[bool],
    shards: &[&LocalShard],
    optimizer: &OptimizerId<'_>,
) -> Result<()> {
    // One exchange: the fingerprints, then the optimizer's settings and the options as text.
    let (mine, not_finite) = fingerprints(params, trained, shards, optimizer)?;
    let texts = serde_json::to_vec(&[&optimizer.settings, &optimizer.options])?;
    let bytes: Vec<u8> = mine
        .iter()
        .flat_map(|f| f.to_le_bytes())
        .chain(texts)
        .collect();
    let all = all_gather_bytes(comm, &bytes)?;
    let table: Vec<[u64; N]> = all
        .iter()
        .map(|r| {
            std::array::from_fn(|i| u64::from_le_bytes(r[8 * i..8 * i + 8].try_into().unwrap()))
        })
        .collect();
    let mut differ: Vec<String> = (0..N)
        .filter_map(|a| {
            let ranks: Vec<usize> = (1..table.len())
                .filter(|&r| table[r][a] != table[0][a])
                .collect();
            (!ranks.is_empty())
                .then(|| format!("{} (ranks {ranks:?} differ from rank 0)", ASPECTS[a]))
        })
        .collect();
    let texts: Vec<[String; 2]> = all
        .iter()
        .map(|r| serde_json::from_slice(&r[8 * N..]))
        .collect::<std::result::Result<_, _>>()?;
    for (k, what) in ["the optimizer's settings", "the FsdpOptions"]
        .iter()
        .enumerate()
    {
        let each: Vec<&[u8]> = texts.iter().map(|t| t[k].as_bytes()).collect();
        differ.extend(settings_differ(what, &each));
    }
    if differ.is_empty() {
        // The ranks agree on the values, so every rank finds the same element.
        return match not_finite {
            None => Ok(()),
            Some(what) => Err(Error::BadInput {
                op: "fully_shard",
                what: format!("initial value of {what} (as f32)"),
                reason: "a trained parameter's starting point must be finite (an f64 beyond \
                         f32::MAX is infinite in the f32 master); the first step would fail, or \
                         under NonFinitePolicy::SkipStep every step be skipped"
                    .into(),
            }),
        };
    }
    Err(Error::BadInput {
        op: "fully_shard",
        what: "the ranks' parameters".into(),
        reason: format!(
            "every rank must pass the same parameters in the same order with the same initial \
             values, and the same optimizer; they disagree on {}",
            differ.join(", ")
        ),
    })
}

/// The settings' first difference from rank 0's (`what`: whose settings), one entry per
/// differing text: the first `field: value` item (of the `Debug` text) that differs, with the
/// ranks.
fn settings_differ(what: &str, settings: &[&[u8]]) -> Option<String> {
    let ranks: Vec<usize> = (1..settings.len())
        .filter(|&r| settings[r] != settings[0])
        .collect();
    let &first = ranks.first()?;
    let text = |r: usize| String::from_utf8_lossy(settings[r]).into_owned();
    // The first setting that differs; texts that are not a struct's differ as a whole.
    let first_difference = differences(&text(0), &text(first)).into_iter().next();
    let show = |path: &str, value: Option<String>| match (path, value) {
        ("", value) => value.unwrap_or_default(),
        (path, value) => format!("{path}: {}", value.as_deref().unwrap_or("no such setting")),
    };
    let (mine, theirs) = first_difference.map_or_else(Default::default, |d| {
        (show(&d.path, d.saved), show(&d.path, d.now))
    });
    Some(format!(
        "{what} (ranks {ranks:?} differ from rank 0; rank 0 has `{mine}`, rank {first} `{theirs}`)"
    ))
}

/// The step's one exchange (an all-gather of 24 bytes a rank): each rank's count of non-finite
/// losses and gradient shards, and the learning rate it is about to step at. Returns the
/// count over all ranks, or the same `Err` on every rank when the rates differ: a
/// `set_learning_rate` or `set_schedule` called on some ranks only moved each rank's shard of
/// the same parameters by its own rate, with no error.
pub(crate) fn step_flags(comm: &dyn Communicator, bad: u64, rate: Option<f64>) -> Result<u64> {
    let mut mine = [0u8; 24];
    mine[..8].copy_from_slice(&bad.to_le_bytes());
    mine[8..16].copy_from_slice(&u64::from(rate.is_some()).to_le_bytes());
    mine[16..].copy_from_slice(&rate.unwrap_or(0.0).to_bits().to_le_bytes());
    let mut all = vec![0u8; 24 * comm.world_size()];
    comm.all_gather(Buf::U8(&mine), BufMut::U8(&mut all))?;
    let word = |r: &[u8], i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&r[8 * i..8 * i + 8]);
        u64::from_le_bytes(w)
    };
    let rates: Vec<(u64, u64)> = all
        .chunks_exact(24)
        .map(|r| (word(r, 1), word(r, 2)))
        .collect();
    let differ: Vec<usize> = (1..rates.len()).filter(|&r| rates[r] != rates[0]).collect();
    if let Some(&other) = differ.first() {
        let show = |(some, bits): (u64, u64)| match some {
            0 => "none".to_string(),
            _ => format!("{:?}", f64::from_bits(bits)),
        };
        return Err(Error::BadInput {
            op: "ShardedModel::step",
            what: "the learning rates of the ranks".into(),
            reason: format!(
                "ranks {differ:?} differ from rank 0: rank {other} would step at {}, rank 0 at \
                 {}; call set_learning_rate and set_schedule on every rank alike (the step was \
                 not taken)",
                show(rates[other]),
                show(rates[0])
            ),
        });
    }
    Ok(all.chunks_exact(24).map(|r| word(r, 0)).sum())
}

/// `flags` OR-ed over the ranks (one all-gather of a byte per flag; every rank passes as
/// many): whether any rank set each.
pub(crate) fn any_rank(comm: &dyn Communicator, flags: &[bool]) -> Result<Vec<bool>> {
    if comm.world_size() == 1 || flags.is_empty() {
        return Ok(flags.to_vec());
    }
    let mine: Vec<u8> = flags.iter().map(|&f| u8::from(f)).collect();
    let mut all = vec![0u8; mine.len() * comm.world_size()];
    comm.all_gather(Buf::U8(&mine), BufMut::U8(&mut all))?;
    let ranks: Vec<&[u8]> = all.chunks_exact(mine.len()).collect();
    Ok((0..mine.len())
        .map(|i| ranks.iter().any(|r| r[i] != 0))
        .collect())
}

/// Exchanges every rank's stage list (`forward_backward`'s units, by name) and returns the
/// same `Err` on every rank unless all equal rank 0's: ranks running different units in
/// lockstep would each train on another unit's gathered values wherever the buffers have the
/// same length (a list built from a `HashMap`, in another order on each rank).
pub(crate) fn check_stages_agree(comm: &dyn Communicator, stages: &[String]) -> Result<()> {
    let all = all_gather_bytes(comm, &serde_json::to_vec(stages)?)?;
    let differ: Vec<usize> = (1..all.len()).filter(|&r| all[r] != all[0]).collect();
    let Some(&other) = differ.first() else {
        return Ok(());
    };
    let list = |r: usize| String::from_utf8_lossy(&all[r]).into_owned();
    Err(Error::BadInput {
        op: "forward_backward",
        what: "the stage lists of the ranks".into(),
        reason: format!(
            "ranks {differ:?} differ from rank 0: rank {other} runs {}, rank 0 runs {}; every \
             rank must run the same units in the same order (build the list in a fixed order, \
             not from a HashMap)",
            list(other),
            list(0)
        ),
    })
}
