//! A write placing bytes into a volume's memory, as far as the page
//! checksums (`--verify-kept-memory`, [`super::pages`]) are concerned.
//!
//! A write counts itself in on its pages before its first byte may land,
//! and out exactly once: when its [`PlacingWrite`] is dropped. The front
//! end keeps the guard with the command, so every way a command ends drops
//! it: completed (before its status), refused after its plan, aborted, its
//! data damaged, its connection gone (an RDMA READ's queue pair is in
//! error by then, so nothing lands after). The last write out of a page
//! records its checksum of what the page holds then: an abandoned write's
//! bytes, if any landed, are part of the content from then on, as on any
//! disk. A page left counted in would never be checked again.

use std::sync::Arc;

use super::Volume;

/// A write's claim on the checksums of the pages it may place bytes into
/// (see the module docs); without page checksums it holds nothing and
/// costs nothing.
#[must_use = "dropping it at once counts the write out before its bytes land"]
#[derive(Debug, Default)]
pub struct PlacingWrite {
    /// `None` when no checksums are kept (or for no write at all).
    volume: Option<Arc<Volume>>,
    offset: u64,
    len: u64,
}

impl PlacingWrite {
    /// No write: nothing to count out.
    pub const NONE: PlacingWrite = PlacingWrite {
        volume: None,
        offset: 0,
        len: 0,
    };
}

impl Drop for PlacingWrite {
    fn drop(&mut self) {
        if let Some(volume) = self.volume.take() {
            if let Some(p) = volume.pages() {
                p.settle(self.offset, self.len);
            }
        }
    }
}

impl Volume {
    /// A write of `len` bytes at `offset` may start placing data: its pages
    /// hold no known content until the returned guard is dropped, which
    /// counts the write out (and records the checksums) exactly once,
    /// however the write ends.
    #[inline]
    pub fn will_write(self: &Arc<Self>, offset: u64, len: u64) -> PlacingWrite {
        if !self.keeps_page_crcs() || len == 0 {
            return PlacingWrite::NONE;
        }
        let Some(p) = self.pages() else {
            return PlacingWrite::NONE;
        };
        p.begin(offset, len);
        PlacingWrite {
            volume: Some(Arc::clone(self)),
            offset,
            len,
        }
    }

    /// Pages a write is counted in now (`--verify-kept-memory`; 0
    /// without it): see [`super::pages::PageCrcs::counted_in`].
    pub fn pages_being_written(&self) -> u64 {
        self.pages().map_or(0, |p| p.counted_in())
    }
}
