//! `torch.randperm(n, generator=g)` for a CPU generator, reproduced bit for bit.
//!
//! torch draws the permutation with a Fisher–Yates shuffle fed by its MT19937 engine, one swap at a
//! time; at a million indices that single call costs more than all the grouping work. Here the engine
//! state is read from `g.get_state()` bytes, the same shuffle runs natively, and the advanced state is
//! written back for `g.set_state()`, so the permutation and the generator afterwards are exactly
//! torch's. The Python side checks this against `torch.randperm` once per process and falls back to
//! torch if they ever disagree (a torch version with another layout or algorithm).

use super::prefetch::prefetch;
use crate::errors::{DataError, DataResult};

const STATE_N: usize = 624;
const STATE_M: usize = 397;
const MATRIX_A: u32 = 0x9908_b0df;
const UPPER_MASK: u32 = 0x8000_0000;
const LOWER_MASK: u32 = 0x7fff_ffff;

/// Size of torch's `CPUGeneratorImplState` (what `get_state()` returns) and the offsets of the fields
/// this code touches: `int left` at 8, `uint64 next` at 16, `uint64 state[624]` at 24.
pub const STATE_BYTES: usize = 5056;
const LEFT_AT: usize = 8;
const NEXT_AT: usize = 16;
const WORDS_AT: usize = 24;

/// Largest `n` for which torch uses the 32-bit shuffle (`n < UINT32_MAX / 20`); above it torch
/// switches to another algorithm, which is left to torch.
pub const MAX_N: usize = (u32::MAX / 20) as usize;

/// ATen's `mt19937_engine`: the standard MT19937 with its own bookkeeping (`left`, `next`).
pub struct Mt19937 {
    left: i32,
    next: usize,
    state: [u32; STATE_N],
}

impl Mt19937 {
    /// Seeds as `torch.Generator().manual_seed(seed)` does (for tests).
    pub fn seeded(seed: u64) -> Self {
        let mut state = [0u32; STATE_N];
        state[0] = seed as u32;
        for j in 1..STATE_N {
            state[j] = 1_812_433_253u32
                .wrapping_mul(state[j - 1] ^ (state[j - 1] >> 30))
                .wrapping_add(j as u32);
        }
        Mt19937 {
            left: 1,
            next: 0,
            state,
        }
    }

    /// Reads the engine from `torch.Generator.get_state()` bytes.
    pub fn from_state_bytes(bytes: &[u8]) -> DataResult<Self> {
        if bytes.len() != STATE_BYTES {
            return Err(DataError::value(format!(
                "a CPU generator state has {STATE_BYTES} bytes, got {}",
                bytes.len()
            )));
        }
        let left = i32::from_le_bytes(bytes[LEFT_AT..LEFT_AT + 4].try_into().unwrap_or_default());
        let next = u64::from_le_bytes(bytes[NEXT_AT..NEXT_AT + 8].try_into().unwrap_or_default());
        // The engine reads words `next..next + left - 1` before it twists: they must exist.
        if !(1..=STATE_N as i32).contains(&left) || next + left as u64 > STATE_N as u64 + 1 {
            return Err(DataError::value(format!(
                "unexpected generator state (left={left}, next={next})"
            )));
        }
        let mut state = [0u32; STATE_N];
        for (j, word) in state.iter_mut().enumerate() {
            let at = WORDS_AT + 8 * j;
            let wide = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or_default());
            *word = u32::try_from(wide).map_err(|_| {
                DataError::value(format!("unexpected generator state word {j}: {wide}"))
            })?;
        }
        Ok(Mt19937 {
            left,
            next: next as usize,
            state,
        })
    }

    /// Writes the engine back into `bytes` (a copy of what `from_state_bytes` read), leaving the
    /// other fields (seed, cached normal samples) as they were, as `torch.randperm` does.
    pub fn write_state_bytes(&self, bytes: &mut [u8]) {
        bytes[LEFT_AT..LEFT_AT + 4].copy_from_slice(&self.left.to_le_bytes());
        bytes[NEXT_AT..NEXT_AT + 8].copy_from_slice(&(self.next as u64).to_le_bytes());
        for (j, word) in self.state.iter().enumerate() {
            let at = WORDS_AT + 8 * j;
            bytes[at..at + 8].copy_from_slice(&u64::from(*word).to_le_bytes());
        }
    }

    pub fn next_u32(&mut self) -> u32 {
        self.left -= 1;
        if self.left == 0 {
            self.twist();
        }
        let mut y = self.state[self.next];
        self.next += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    fn twist(&mut self) {
        let mix = |u: u32, v: u32| {
            let bits = (u & UPPER_MASK) | (v & LOWER_MASK);
            (bits >> 1) ^ if v & 1 == 1 { MATRIX_A } else { 0 }
        };
        for j in 0..STATE_N {
            let following = self.state[(j + 1) % STATE_N];
            self.state[j] = self.state[(j + STATE_M) % STATE_N] ^ mix(self.state[j], following);
        }
        self.left = STATE_N as i32;
        self.next = 0;
    }
}

/// torch's CPU `randperm` for `n < MAX_N`: identity, then for each `i` swap `i` with
/// `i + random() % (n - i)`.
///
/// Same result, faster loop: the draws do not depend on the array, so they are all made first, and
/// the swaps then run on 32-bit entries (half the cache footprint) with independent addresses the
/// CPU can overlap; the swap targets are prefetched a few steps ahead.
pub fn randperm(n: usize, rng: &mut Mt19937) -> DataResult<Vec<i64>> {
    if n >= MAX_N {
        return Err(DataError::value(format!(
            "randperm here is for n < {MAX_N}, got {n}"
        )));
    }
    let targets: Vec<u32> = (0..n.saturating_sub(1))
        .map(|i| i as u32 + rng.next_u32() % (n - i) as u32)
        .collect();
    let mut perm: Vec<u32> = (0..n as u32).collect();
    for (i, &target) in targets.iter().enumerate() {
        if let Some(&ahead) = targets.get(i + PREFETCH_DISTANCE) {
            prefetch(&perm, ahead as usize);
        }
        perm.swap(i, target as usize);
    }
    Ok(perm.into_iter().map(i64::from).collect())
}

const PREFETCH_DISTANCE: usize = 16;
