//! Combining the CRC32C of two pieces into that of both together, in constant time.
//!
//! A prepared entry's frame is checksummed piece by piece: the rows outside the store's
//! lock, the few bytes numbered under it ([`super::PreparedFrame`]). `crc32c::crc32c_combine`
//! squares 32×32 bit matrices once per bit of the length, about 20 µs a call, and each frame
//! combined three times: on an r = 3 replica that was 2–3% of a publish's CPU. This is
//! zlib's newer method (`crc32_combine64`, 1.2.12): the first CRC multiplied by x^(8·len)
//! modulo the polynomial, the power made of a table of x^(2^k).

/// CRC32C's polynomial, bit-reflected (as the checksum is computed).
const POLYNOMIAL: u32 = 0x82F6_3B78;

/// `a · b` modulo the polynomial, both bit-reflected (x^0 is the top bit).
const fn multiply(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut bit = 1u32 << 31;
    while bit != 0 {
        if a & bit != 0 {
            product ^= b;
        }
        bit >>= 1;
        b = if b & 1 != 0 {
            (b >> 1) ^ POLYNOMIAL
        } else {
            b >> 1
        };
    }
    product
}

/// x^(2^k) modulo the polynomial, for every k a bit length of a `u64` byte count needs.
/// (zlib keeps 32 and indexes them modulo 32, which holds for its polynomial but not for
/// CRC32C's: a length of 2^33 bytes came out wrong.)
const POWERS: [u32; 67] = {
    let mut table = [0u32; 67];
    let mut power = 1u32 << 30; // x^1
    let mut k = 0;
    while k < 67 {
        table[k] = power;
        power = multiply(power, power);
        k += 1;
    }
    table
};

/// x^(8·bytes) modulo the polynomial: what appending `bytes` zero bytes multiplies by.
fn shift_of(mut bytes: u64) -> u32 {
    let mut shift = 1u32 << 31; // x^0
    let mut k = 3; // 8 bits a byte: start at x^(2^3)
    while bytes != 0 {
        if bytes & 1 != 0 {
            shift = multiply(POWERS[k], shift);
        }
        bytes >>= 1;
        k += 1;
    }
    shift
}

/// The CRC32C of `a` followed by `b`, from `crc32c(a)`, `crc32c(b)` and `b`'s length.
pub fn combine(crc_a: u32, crc_b: u32, len_b: usize) -> u32 {
    multiply(shift_of(len_b as u64), crc_a) ^ crc_b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combined_checksums_equal_the_checksum_of_the_whole() {
        let bytes: Vec<u8> = (0..70_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for split in [0, 1, 7, 4096, 33_333, 69_999, 70_000] {
            let (a, b) = bytes.split_at(split);
            let whole = crc32c::crc32c(&bytes);
            assert_eq!(
                combine(crc32c::crc32c(a), crc32c::crc32c(b), b.len()),
                whole,
                "split at {split}"
            );
            assert_eq!(
                combine(crc32c::crc32c(a), crc32c::crc32c(b), b.len()),
                crc32c::crc32c_combine(crc32c::crc32c(a), crc32c::crc32c(b), b.len()),
                "split at {split}"
            );
        }
    }

    #[test]
    fn lengths_beyond_a_frame_agree_with_the_crate() {
        for len in [1usize << 20, (1 << 26) + 12_345, (1 << 33) + 1] {
            assert_eq!(
                combine(0x1234_5678, 0x9abc_def0, len),
                crc32c::crc32c_combine(0x1234_5678, 0x9abc_def0, len),
                "length {len}"
            );
        }
    }
}
