//! RFC 1982 serial number arithmetic on 32-bit sequence numbers (CmdSN, StatSN,
//! DataSN, R2TSN), as RFC 7143 section 4.2.2.1 requires.

/// `a < b` in serial arithmetic.
pub fn lt(a: u32, b: u32) -> bool {
    a != b && b.wrapping_sub(a) < (1 << 31)
}

/// `a <= b` in serial arithmetic.
pub fn le(a: u32, b: u32) -> bool {
    a == b || lt(a, b)
}

/// `a > b` in serial arithmetic.
pub fn gt(a: u32, b: u32) -> bool {
    lt(b, a)
}

/// Whether `sn` lies in the inclusive window `[low, high]`.
pub fn in_window(sn: u32, low: u32, high: u32) -> bool {
    le(low, sn) && le(sn, high)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps_around() {
        assert!(lt(u32::MAX, 0));
        assert!(gt(0, u32::MAX));
        assert!(lt(5, 6));
        assert!(!lt(6, 6));
        assert!(le(6, 6));
        assert!(in_window(1, u32::MAX - 3, 3));
        assert!(!in_window(4, u32::MAX - 3, 3));
    }
}
