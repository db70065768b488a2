//! Page checksums of a LUN's memory (`--verify-kept-memory`): a CRC32C of
//! every 4 KiB page, kept in the LUN's record memfd so that it outlives the
//! process with the memory. After a writer died of a fault (a panic, a
//! SIGSEGV), its memory may hold bytes nobody wrote; a successor checks
//! every page against its checksum and serves the memory only if all agree.
//!
//! Each page has one 64-bit word: the number of writes under way to it in
//! the high half, the checksum of its content in the low half. A write
//! counts itself in before its data may land ([`PageCrcs::begin`]), and
//! out exactly once, however it ends (completed, before its status;
//! refused, aborted, its connection gone: `super::PlacingWrite` does it
//! when dropped); the last one out computes the checksum
//! ([`PageCrcs::settle`]). A page with writes under way when the process
//! died holds no known content (none of those writes was acknowledged, so
//! old, new or torn bytes are all allowed): it is not checked.
//!
//! What it catches: a wild CPU write into a page no command was writing.
//! What it does not: a wild write into a page whose checksum is computed
//! after it (a page being written), bytes a host wrote wrongly, or the
//! memory of the process that was still alive when it went wrong. The
//! other half of the ZFS mirror and the ZIL's own checksums remain the real
//! defence.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::store::Store;

/// Bytes each checksum covers.
pub const PAGE: u64 = 4096;
const ONE_WRITE: u64 = 1 << 32;

/// Words a table needs for a LUN of `lun_bytes`.
pub fn table_words(lun_bytes: u64) -> usize {
    lun_bytes.div_ceil(PAGE) as usize
}

/// The checksums of `data`'s pages, in `table` from word `first_word`.
pub struct PageCrcs<'a> {
    data: &'a Store,
    table: &'a Store,
    first_word: usize,
    pages: u64,
}

/// What a check of every page found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageCheck {
    pub pages: u64,
    /// Pages with a write under way when the writer died: not checked.
    pub in_flight: u64,
    /// Pages whose content does not match their checksum.
    pub differ: u64,
    /// The LUN offset of the first of them.
    pub first_differ: Option<u64>,
    pub took: Duration,
}

impl<'a> PageCrcs<'a> {
    /// `None` if `table` has fewer than one word per page after `first_word`.
    pub fn new(data: &'a Store, table: &'a Store, first_word: usize) -> Option<PageCrcs<'a>> {
        let pages = data.len().div_ceil(PAGE);
        table.word(first_word + pages.checked_sub(1)? as usize)?;
        Some(PageCrcs {
            data,
            table,
            first_word,
            pages,
        })
    }

    fn slot(&self, page: u64) -> Option<&AtomicU64> {
        self.table.word(self.first_word + page as usize)
    }

    fn crc(&self, page: u64) -> u64 {
        let at = page * PAGE;
        let len = (self.data.len() - at).min(PAGE) as usize;
        self.data.crc32c_small(at, len).map_or(0, u64::from)
    }

    /// The pages `len` bytes at `offset` touch.
    fn touched(&self, offset: u64, len: u64) -> std::ops::Range<u64> {
        if len == 0 || offset >= self.data.len() {
            return 0..0;
        }
        let last = (offset.saturating_add(len) - 1) / PAGE;
        offset / PAGE..last.min(self.pages - 1) + 1
    }

    /// A write of `len` bytes at `offset` may start placing data.
    pub fn begin(&self, offset: u64, len: u64) {
        for page in self.touched(offset, len) {
            if let Some(slot) = self.slot(page) {
                slot.fetch_add(ONE_WRITE, Ordering::SeqCst);
            }
        }
    }

    /// A write of `len` bytes at `offset` placed its data (or one that
    /// never counted itself in changed the memory): the last write out of
    /// each page records its checksum.
    pub fn settle(&self, offset: u64, len: u64) {
        self.settle_with(offset, len, |page| self.crc(page));
    }

    /// [`Self::settle`], the checksum of a page computed by `crc_of` (the
    /// tests step into that moment).
    fn settle_with(&self, offset: u64, len: u64, crc_of: impl Fn(u64) -> u64) {
        for page in self.touched(offset, len) {
            let Some(slot) = self.slot(page) else {
                continue;
            };
            // Count this write out (one that never counted itself in has
            // nothing to count out).
            let before = slot
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                    (v >= ONE_WRITE).then(|| v - ONE_WRITE)
                })
                .unwrap_or_else(|v| v);
            let after = if before >= ONE_WRITE {
                before - ONE_WRITE
            } else {
                before
            };
            // The last one out records the checksum. Its exchange fails when
            // the word changed while it computed: a write under way now
            // records it when it ends; none under way, the word holds a
            // checksum computed by another (maybe before this write's data:
            // a write that counted in and out meanwhile restores the word it
            // read, so that one's exchange went in), and this write computes
            // again from the content as it is now. The last write to end is
            // thus always the last to record. The word's layout is unchanged.
            let mut seen = after;
            while seen < ONE_WRITE {
                match slot.compare_exchange(seen, crc_of(page), Ordering::SeqCst, Ordering::SeqCst)
                {
                    Ok(_) => break,
                    Err(now) => seen = now,
                }
            }
        }
    }

    /// Record the checksum of every page as it is now, nothing under way
    /// (memory just filled by a restore, zeroed, or taken over).
    pub fn rebuild(&self) -> Duration {
        let started = Instant::now();
        for page in 0..self.pages {
            if let Some(slot) = self.slot(page) {
                slot.store(self.crc(page), Ordering::SeqCst);
            }
        }
        started.elapsed()
    }

    /// Every page zero: one checksum for all (the last page's may be
    /// shorter). Computed, never read: memory not yet taken
    /// ([`Store::reserved`]) must not be touched.
    pub fn zeroed(&self) {
        const ZEROS: [u8; PAGE as usize] = [0; PAGE as usize];
        let full = u64::from(crc32c::crc32c(&ZEROS));
        for page in 0..self.pages {
            if let Some(slot) = self.slot(page) {
                slot.store(full, Ordering::SeqCst);
            }
        }
        let last = self.pages - 1;
        let tail = (self.data.len() - last * PAGE).min(PAGE) as usize;
        if let Some(slot) = self.slot(last) {
            slot.store(u64::from(crc32c::crc32c(&ZEROS[..tail])), Ordering::SeqCst);
        }
    }

    /// Pages a dead writer left with writes under way get the checksum of
    /// what they hold now: this process serves that as their content.
    pub fn settle_abandoned(&self) -> u64 {
        let mut n = 0;
        for page in 0..self.pages {
            if let Some(slot) = self.slot(page) {
                if slot.load(Ordering::SeqCst) >= ONE_WRITE {
                    slot.store(self.crc(page), Ordering::SeqCst);
                    n += 1;
                }
            }
        }
        n
    }

    /// Pages with a write counted in now. Once nothing is under way
    /// (every connection gone, at a clean stop) it must be 0: a page left
    /// counted is never checked again.
    pub fn counted_in(&self) -> u64 {
        (0..self.pages)
            .filter_map(|page| self.slot(page))
            .filter(|slot| slot.load(Ordering::SeqCst) >= ONE_WRITE)
            .count() as u64
    }

    /// Check every page against its checksum.
    pub fn check(&self) -> PageCheck {
        let started = Instant::now();
        let mut c = PageCheck {
            pages: self.pages,
            ..PageCheck::default()
        };
        for page in 0..self.pages {
            let Some(v) = self.slot(page).map(|s| s.load(Ordering::SeqCst)) else {
                continue;
            };
            if v >= ONE_WRITE {
                c.in_flight += 1;
            } else if v != self.crc(page) {
                c.differ += 1;
                c.first_differ.get_or_insert(page * PAGE);
            }
        }
        c.took = started.elapsed();
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::HugePages;

    fn stores(lun: u64) -> (Store, Store) {
        let data = Store::new(lun, HugePages::Off).expect("data");
        let table = Store::new(4096, HugePages::Off).expect("table");
        (data, table)
    }

    /// A write that slips in whole while the last one out computes its
    /// checksum (it counts in and out, so the word reads as before: ABA)
    /// must not leave the older checksum in place: the page's content is
    /// the later write's. (Fails safe, good memory refused after a fault,
    /// but refused nonetheless.)
    #[test]
    fn a_stale_checksum_never_outlives_the_last_write() {
        use std::sync::atomic::AtomicBool;
        use std::sync::Barrier;
        let (data, table) = stores(64 << 10);
        let crcs = PageCrcs::new(&data, &table, 0).expect("table");
        crcs.zeroed();
        // A wrote page 0 and is the last one out.
        crcs.begin(0, 4096);
        data.write(0, &[0xaa; 4096]).expect("A");
        let stale = crcs.crc(0);
        let (b_computing, b_may_go) = (Barrier::new(2), Barrier::new(2));
        let b_waited = AtomicBool::new(false);
        std::thread::scope(|s| {
            crcs.settle_with(0, 4096, |_| {
                // B writes the whole page while A computes: it counts in,
                // places, counts out, and stops where it computes.
                s.spawn(|| {
                    crcs.begin(0, 4096);
                    data.write(0, &[0xbb; 4096]).expect("B");
                    crcs.settle_with(0, 4096, |page| {
                        if !b_waited.swap(true, Ordering::SeqCst) {
                            b_computing.wait();
                            b_may_go.wait();
                        }
                        crcs.crc(page)
                    });
                });
                b_computing.wait();
                // A's checksum, of the content before B's write.
                stale
            });
            b_may_go.wait();
        });
        assert!(b_waited.load(Ordering::SeqCst), "B never slipped in");
        let c = crcs.check();
        assert_eq!(
            (c.differ, c.in_flight),
            (0, 0),
            "the page holds B's write under A's older checksum"
        );
    }

    /// Every page checks after writes that settle, including overlapping
    /// ones finishing in either order; a byte changed behind the table's
    /// back is found at its page; a page with a write under way is not
    /// checked; a table too small is refused.
    #[test]
    fn pages_check_until_a_byte_changes_behind_their_back() {
        let (data, table) = stores(64 << 10);
        let crcs = PageCrcs::new(&data, &table, 1).expect("table");
        crcs.zeroed();
        assert_eq!(crcs.check().differ, 0);
        // Two writes into page 2, the first to start ends last.
        crcs.begin(8192, 512);
        crcs.begin(8192 + 512, 512);
        data.write(8192, &[1; 512]).expect("w");
        data.write(8192 + 512, &[2; 512]).expect("w");
        assert_eq!(crcs.check().in_flight, 1);
        crcs.settle(8192 + 512, 512);
        assert_eq!(crcs.check().in_flight, 1, "one write still under way");
        crcs.settle(8192, 512);
        let c = crcs.check();
        assert_eq!((c.in_flight, c.differ), (0, 0), "{c:?}");
        // A write across pages 4..6, settled without a begin (a path that
        // changes memory outside a command).
        data.write(4 * 4096 + 100, &[3; 9000]).expect("w");
        crcs.settle(4 * 4096 + 100, 9000);
        assert_eq!(crcs.check().differ, 0);
        // A stray write.
        data.write(10 * 4096 + 7, &[9]).expect("w");
        let c = crcs.check();
        assert_eq!((c.differ, c.first_differ), (1, Some(10 * 4096)));
        crcs.rebuild();
        assert_eq!(crcs.check().differ, 0);
        // A write that began and never ended: not checked, until settled
        // as abandoned.
        crcs.begin(0, 1);
        data.write(0, &[7]).expect("w");
        let c = crcs.check();
        assert_eq!((c.pages, c.in_flight, c.differ), (16, 1, 0));
        assert_eq!(crcs.settle_abandoned(), 1);
        assert_eq!(crcs.check().differ + crcs.check().in_flight, 0);
        assert!(PageCrcs::new(&data, &table, 512 - 16).is_some());
        assert!(
            PageCrcs::new(&data, &table, 512 - 15).is_none(),
            "one word short"
        );
    }
}
