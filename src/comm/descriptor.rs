//! A rank's call ([`Post`]) as words on the wire, for backends whose ranks share no memory
//! (MPI, NCCL). Before moving data their ranks all-gather these descriptors, and every rank
//! runs the thread backend's validation (`protocol::validate`) and [`check_same_layout`] on
//! the same table: either all move data or all return the same `Err`, never a hang or a
//! silent mix of two calls.

use super::protocol::{Op, Post, Region};
use super::{ElemType, ReduceOp, Segment};

const OPS: [Op; 8] = [
    Op::AllGatherInPlace,
    Op::AllGather,
    Op::ReduceScatterInPlace,
    Op::ReduceScatter,
    Op::AllReduce,
    Op::AllToAllV,
    Op::Broadcast,
    Op::Barrier,
];
const ELEMS: [ElemType; 3] = [ElemType::F32, ElemType::BF16, ElemType::U8];

/// Header words: the [`Post`]'s nine, then the rank's [`Words`].
pub(crate) const HEADER: usize = 11;

/// What a rank's descriptor carries beyond its [`Post`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Words {
    /// [`layout_digest`] of its segments, [`NO_LAYOUT`] for other calls.
    pub(crate) layout: u64,
    /// One word the backend uses as it will (MPI: the rank's largest message).
    pub(crate) extra: u64,
}

/// The layout word of a call that gathers into no segments.
pub(crate) const NO_LAYOUT: u64 = 0;

/// A digest of the segments' offsets and lengths (FNV-1a over their words; never
/// [`NO_LAYOUT`], so a segmented gather never passes for a plain one).
pub(crate) fn layout_digest(segments: &[Segment<'_>]) -> u64 {
    let words = segments.iter().flat_map(|s| [s.offset, s.buf.len()]);
    let hash = words.fold(0xcbf2_9ce4_8422_2325u64, |h, w| {
        (h ^ w as u64).wrapping_mul(0x0100_0000_01b3)
    });
    hash.max(1)
}

/// `Err` naming the first rank whose segment layout differs from rank 0's (`backend` names
/// where: "over MPI").
pub(crate) fn check_same_layout(words: &[Words], backend: &str) -> Result<(), String> {
    match words.iter().position(|w| w.layout != words[0].layout) {
        None => Ok(()),
        Some(j) => Err(format!(
            "rank {j} gathers into segments laid out otherwise than rank 0 (other offsets or \
             lengths, or no segments where rank 0 has some): {backend} every rank must pass \
             the same segments to all_gather_segments, since each sends only the pieces of its \
             shard that the segments cover"
        )),
    }
}

fn index_of<T: PartialEq>(all: &[T], x: &T) -> u64 {
    all.iter().position(|y| y == x).expect("listed") as u64
}

/// The fixed-size part of a descriptor.
pub(crate) fn header(p: &Post, words: Words) -> [u64; HEADER] {
    let reduce = match p.reduce {
        None => 0,
        Some(ReduceOp::Sum) => 1,
        Some(ReduceOp::Avg) => 2,
    };
    [
        index_of(&OPS, &p.op),
        p.send.len as u64,
        index_of(&ELEMS, &p.send.elem),
        p.recv.len as u64,
        index_of(&ELEMS, &p.recv.elem),
        reduce,
        p.root as u64,
        p.send_counts.len() as u64,
        p.recv_counts.len() as u64,
        words.layout,
        words.extra,
    ]
}

/// The call a header describes (counts empty: [`decode`] fills them).
fn from_header(h: &[u64]) -> Post {
    let elem = |k: u64| ELEMS[k as usize % ELEMS.len()];
    let region = |len: u64, e: u64| Region::new(std::ptr::null_mut(), len as usize, elem(e));
    Post {
        op: OPS[h[0] as usize % OPS.len()],
        send: region(h[1], h[2]),
        recv: region(h[3], h[4]),
        reduce: match h[5] {
            1 => Some(ReduceOp::Sum),
            2 => Some(ReduceOp::Avg),
            _ => None,
        },
        root: h[6] as usize,
        send_counts: Vec::new(),
        recv_counts: Vec::new(),
    }
}

/// Every rank's call and words from `all`, the all-gathered headers of `v` ranks. When every
/// rank calls all-to-all-v, their counts come from `gather_counts`, which all-gathers this
/// rank's `2·V` words (its call `mine`'s send then receive counts, padded to `V` each; the
/// true lengths ride in the header, so a wrong length still fails validation on every rank).
pub(crate) fn decode<E>(
    all: &[u64],
    v: usize,
    mine: &Post,
    gather_counts: impl FnOnce(&[u64]) -> Result<Vec<u64>, E>,
) -> Result<(Vec<Post>, Vec<Words>), E> {
    let mut posts: Vec<Post> = all.chunks(HEADER).map(from_header).collect();
    if posts.iter().all(|p| p.op == Op::AllToAllV) {
        let fixed = |c: &[usize]| -> Vec<u64> {
            (0..v).map(|j| c.get(j).map_or(0, |&x| x as u64)).collect()
        };
        let mut counts = fixed(&mine.send_counts);
        counts.extend(fixed(&mine.recv_counts));
        let table = gather_counts(&counts)?;
        for ((p, row), h) in posts
            .iter_mut()
            .zip(table.chunks(2 * v))
            .zip(all.chunks(HEADER))
        {
            let (ns, nr) = (h[7] as usize, h[8] as usize);
            let take = |part: &[u64], n: usize| -> Vec<usize> {
                (0..n)
                    .map(|j| part.get(j).map_or(0, |&x| x as usize))
                    .collect()
            };
            p.send_counts = take(&row[..v], ns);
            p.recv_counts = take(&row[v..], nr);
        }
    }
    let words = all
        .chunks(HEADER)
        .map(|h| Words {
            layout: h[HEADER - 2],
            extra: h[HEADER - 1],
        })
        .collect();
    Ok((posts, words))
}
