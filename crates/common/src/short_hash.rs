//! BLAKE3 of many short inputs at once, for the partition hash.
//!
//! A partition key's canonical encoding is almost always one BLAKE3 block (at most 64
//! bytes: an integer key is 9). Hashing such an input is one compression, and
//! `blake3::hash` does one at a time, about 50–100 ns each: in a storage-hash exchange of
//! a million rows that was a third of the query's CPU. Here 16 inputs are compressed side
//! by side, each of the 16 state words held as 16 lanes, which the compiler turns into
//! vector instructions (AVX-512 or AVX2 where the processor has them, chosen at run time).
//!
//! The output is exactly `blake3::hash(input)`'s first 8 bytes as a little-endian `u64`:
//! one block, chunk counter 0, flags `CHUNK_START | CHUNK_END | ROOT` (BLAKE3 spec §2.5,
//! §2.6). Tests compare it with the `blake3` crate for every length and many inputs; the
//! partition hash decides where rows live on disk and must never change.

/// Inputs hashed side by side.
pub const LANES: usize = 16;
/// The longest input hashed here: one BLAKE3 block.
pub const MAX_LEN: usize = 64;

const IV: [u32; 8] = [
    0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19,
];
const MSG_PERMUTATION: [usize; 16] = [2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8];
/// `CHUNK_START | CHUNK_END | ROOT`: the one block of a one-block input.
const ONE_BLOCK_ROOT: u32 = 1 | 2 | 8;

type Words = [u32; LANES];

/// Up to [`LANES`] inputs of at most [`MAX_LEN`] bytes, each zero-padded to a block and
/// held as the block's 16 message words, word by word across the lanes.
#[derive(Clone)]
pub struct ShortInputs {
    message: [Words; 16],
    lens: Words,
    /// Per lane, how many message words may be nonzero.
    written: [usize; LANES],
    used: usize,
}

impl Default for ShortInputs {
    fn default() -> Self {
        ShortInputs {
            message: [[0; LANES]; 16],
            lens: [0; LANES],
            written: [0; LANES],
            used: 0,
        }
    }
}

impl ShortInputs {
    pub fn is_full(&self) -> bool {
        self.used == LANES
    }

    /// Adds an input. Panics if it is longer than a block or all lanes are taken.
    pub fn push(&mut self, input: &[u8]) {
        assert!(input.len() <= MAX_LEN, "a short input fits one block");
        assert!(!self.is_full(), "a free lane");
        let lane = self.used;
        // Only the words the input covers are written (a key is usually 3 of 16), and the
        // words a longer input left in this lane before are zeroed again: the padding.
        let chunks = input.chunks(4);
        let words = chunks.len();
        for (word, chunk) in chunks.enumerate() {
            let mut bytes = [0u8; 4];
            bytes[..chunk.len()].copy_from_slice(chunk);
            self.message[word][lane] = u32::from_le_bytes(bytes);
        }
        for word in words..self.written[lane] {
            self.message[word][lane] = 0;
        }
        self.written[lane] = words;
        self.lens[lane] = input.len() as u32;
        self.used += 1;
    }

    /// Adds the 9-byte input `tag` then `value`'s bytes, without gathering them first: the
    /// encoding of an integer key, the commonest kind.
    pub fn push_tagged(&mut self, tag: u8, value: [u8; 8]) {
        assert!(!self.is_full(), "a free lane");
        let lane = self.used;
        let [b0, b1, b2, b3, b4, b5, b6, b7] = value;
        self.message[0][lane] = u32::from_le_bytes([tag, b0, b1, b2]);
        self.message[1][lane] = u32::from_le_bytes([b3, b4, b5, b6]);
        self.message[2][lane] = u32::from(b7);
        for word in 3..self.written[lane] {
            self.message[word][lane] = 0;
        }
        self.written[lane] = 3;
        self.lens[lane] = 9;
        self.used += 1;
    }

    /// The first 8 bytes (little endian) of each input's BLAKE3 hash, in order; empties the
    /// lanes (nothing if they are empty).
    pub fn hash_into(&mut self, out: &mut Vec<u64>) {
        if self.used == 0 {
            return;
        }
        let hashes = hash_lanes(&self.message, &self.lens);
        out.extend_from_slice(&hashes[..self.used]);
        self.used = 0;
    }
}

/// Chooses the widest vector instructions this processor has.
fn hash_lanes(message: &[Words; 16], lens: &Words) -> [u64; LANES] {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the processor was just found to support AVX-512F.
            return unsafe { hash_lanes_avx512(message, lens) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the processor was just found to support AVX2.
            return unsafe { hash_lanes_avx2(message, lens) };
        }
    }
    hash_lanes_portable(message, lens)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn hash_lanes_avx512(message: &[Words; 16], lens: &Words) -> [u64; LANES] {
    hash_lanes_portable(message, lens)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn hash_lanes_avx2(message: &[Words; 16], lens: &Words) -> [u64; LANES] {
    hash_lanes_portable(message, lens)
}

/// Which message word each round's position reads: BLAKE3's permutation applied round
/// after round, worked out once rather than by moving the words.
const SCHEDULE: [[usize; 16]; 7] = {
    let mut schedule = [[0usize; 16]; 7];
    let mut i = 0;
    while i < 16 {
        schedule[0][i] = i;
        i += 1;
    }
    let mut round = 1;
    while round < 7 {
        let mut i = 0;
        while i < 16 {
            schedule[round][i] = schedule[round - 1][MSG_PERMUTATION[i]];
            i += 1;
        }
        round += 1;
    }
    schedule
};

/// Inlined into each caller above, so that it is compiled for that caller's instructions.
#[inline(always)]
fn hash_lanes_portable(message: &[Words; 16], lens: &Words) -> [u64; LANES] {
    let mut state: [Words; 16] = [
        [IV[0]; LANES],
        [IV[1]; LANES],
        [IV[2]; LANES],
        [IV[3]; LANES],
        [IV[4]; LANES],
        [IV[5]; LANES],
        [IV[6]; LANES],
        [IV[7]; LANES],
        [IV[0]; LANES],
        [IV[1]; LANES],
        [IV[2]; LANES],
        [IV[3]; LANES],
        [0; LANES], // chunk counter, low word
        [0; LANES], // chunk counter, high word
        *lens,
        [ONE_BLOCK_ROOT; LANES],
    ];
    for s in &SCHEDULE {
        let m = |i: usize| &message[s[i]];
        // Columns, then diagonals.
        g(&mut state, [0, 4, 8, 12], m(0), m(1));
        g(&mut state, [1, 5, 9, 13], m(2), m(3));
        g(&mut state, [2, 6, 10, 14], m(4), m(5));
        g(&mut state, [3, 7, 11, 15], m(6), m(7));
        g(&mut state, [0, 5, 10, 15], m(8), m(9));
        g(&mut state, [1, 6, 11, 12], m(10), m(11));
        g(&mut state, [2, 7, 8, 13], m(12), m(13));
        g(&mut state, [3, 4, 9, 14], m(14), m(15));
    }
    // The output's first two words: state[i] ^ state[i + 8].
    std::array::from_fn(|lane| {
        let low = state[0][lane] ^ state[8][lane];
        let high = state[1][lane] ^ state[9][lane];
        u64::from(low) | (u64::from(high) << 32)
    })
}

/// BLAKE3's quarter-round on four state words, in every lane.
#[inline(always)]
fn g(state: &mut [Words; 16], [a, b, c, d]: [usize; 4], mx: &Words, my: &Words) {
    for lane in 0..LANES {
        let (mut va, mut vb, mut vc, mut vd) = (
            state[a][lane],
            state[b][lane],
            state[c][lane],
            state[d][lane],
        );
        va = va.wrapping_add(vb).wrapping_add(mx[lane]);
        vd = (vd ^ va).rotate_right(16);
        vc = vc.wrapping_add(vd);
        vb = (vb ^ vc).rotate_right(12);
        va = va.wrapping_add(vb).wrapping_add(my[lane]);
        vd = (vd ^ va).rotate_right(8);
        vc = vc.wrapping_add(vd);
        vb = (vb ^ vc).rotate_right(7);
        state[a][lane] = va;
        state[b][lane] = vb;
        state[c][lane] = vc;
        state[d][lane] = vd;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(input: &[u8]) -> u64 {
        u64::from_le_bytes(blake3::hash(input).as_bytes()[..8].try_into().unwrap())
    }

    fn hashed(inputs: &[Vec<u8>]) -> Vec<u64> {
        let mut lanes = ShortInputs::default();
        let mut out = Vec::new();
        for input in inputs {
            lanes.push(input);
            if lanes.is_full() {
                lanes.hash_into(&mut out);
            }
        }
        lanes.hash_into(&mut out);
        out
    }

    #[test]
    fn a_tagged_integer_hashes_as_its_nine_bytes_do() {
        let mut lanes = ShortInputs::default();
        let mut out = Vec::new();
        let mut expected = Vec::new();
        // A lane that held a longer input is reused for a tagged one.
        let long = [7u8; 40];
        lanes.push(&long);
        expected.push(reference(&long));
        for value in [0i64, 1, -1, 42, i64::MIN, i64::MAX, 1 << 40] {
            lanes.push_tagged(0x01, value.to_be_bytes());
            let mut nine = vec![0x01];
            nine.extend_from_slice(&value.to_be_bytes());
            expected.push(reference(&nine));
        }
        lanes.hash_into(&mut out);
        lanes.push_tagged(0x02, 5u64.to_be_bytes());
        lanes.hash_into(&mut out);
        let mut nine = vec![0x02];
        nine.extend_from_slice(&5u64.to_be_bytes());
        expected.push(reference(&nine));
        assert_eq!(out, expected);
    }

    #[test]
    fn every_length_of_a_block_hashes_as_blake3_does() {
        let inputs: Vec<Vec<u8>> = (0..=MAX_LEN)
            .map(|len| (0..len).map(|i| (i * 37 + len * 11 + 5) as u8).collect())
            .collect();
        let expected: Vec<u64> = inputs.iter().map(|i| reference(i)).collect();
        assert_eq!(hashed(&inputs), expected);
    }

    #[test]
    fn many_inputs_of_mixed_lengths_hash_as_blake3_does_on_every_path() {
        // A reused lane must not keep the bytes of a longer input before it.
        let mut seed = 0x9E3779B97F4A7C15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let inputs: Vec<Vec<u8>> = (0..5_000)
            .map(|_| {
                let len = (next() % (MAX_LEN as u64 + 1)) as usize;
                (0..len).map(|_| next() as u8).collect()
            })
            .collect();
        let expected: Vec<u64> = inputs.iter().map(|i| reference(i)).collect();
        assert_eq!(hashed(&inputs), expected);
        for group in inputs.chunks(LANES) {
            let mut lanes = ShortInputs::default();
            for input in group {
                lanes.push(input);
            }
            let portable = hash_lanes_portable(&lanes.message, &lanes.lens);
            for (input, hash) in group.iter().zip(portable) {
                assert_eq!(hash, reference(input));
            }
            // Each vector path this processor has, not only the widest that is chosen.
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the processor was just found to support AVX2.
                let avx2 = unsafe { hash_lanes_avx2(&lanes.message, &lanes.lens) };
                assert_eq!(avx2, portable);
            }
        }
    }
}
