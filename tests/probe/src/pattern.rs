//! The byte pattern that `fill`/`check` (and simgpu's `simgpu-pattern`, which includes this
//! file) write and verify: `(first + i) mod 256` at offset `i` of an allocation.

/// The pattern's bytes at offsets `from..from + len` of an allocation.
pub fn pattern(first: u8, from: usize, len: usize) -> Vec<u8> {
    // One 256-byte period, repeated: quick even in a debug build, for GiBs.
    let start = first.wrapping_add(from as u8);
    let period: Vec<u8> = (0..=255u8).map(|i| start.wrapping_add(i)).collect();
    let mut bytes = Vec::with_capacity(len);
    while bytes.len() < len {
        let take = (len - bytes.len()).min(period.len());
        bytes.extend_from_slice(&period[..take]);
    }
    bytes
}

/// The first byte of `found`, read at offset `from`, that breaks the pattern: its offset from
/// the allocation's start, the byte found and the one expected.
pub fn first_mismatch(first: u8, from: usize, found: &[u8]) -> Option<(usize, u8, u8)> {
    let expected = pattern(first, from, found.len());
    if found == expected.as_slice() {
        return None;
    }
    found
        .iter()
        .zip(&expected)
        .position(|(a, b)| a != b)
        .map(|i| (from + i, found[i], expected[i]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pattern_counts_up_from_its_first_byte_and_wraps_and_a_mismatch_is_located() {
        assert_eq!(pattern(254, 0, 4), vec![254, 255, 0, 1]);
        assert_eq!(pattern(0, 256 + 5, 2), vec![5, 6]);
        assert_eq!(pattern(9, 0, 600)[300], 9u8.wrapping_add(44));
        assert_eq!(first_mismatch(3, 0, &[3, 4, 5]), None);
        assert_eq!(first_mismatch(3, 100, &[103, 0, 105]), Some((101, 0, 104)));
        assert_eq!(
            first_mismatch(0, 0, &[0, 0]),
            Some((1, 0, 1)),
            "zeros are no pattern"
        );
    }
}
