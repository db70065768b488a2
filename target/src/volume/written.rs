//! Which chunks of a volume were written since its last clean image: what
//! the next dump writes.

use std::sync::atomic::{AtomicU64, Ordering};

use super::CHUNK_SIZE;

/// One bit per chunk, set on the write path without allocating or locking.
pub struct WrittenChunks {
    words: Box<[AtomicU64]>,
    chunks: u64,
}

impl WrittenChunks {
    pub(super) fn new(size: u64) -> WrittenChunks {
        let chunks = size.div_ceil(CHUNK_SIZE);
        WrittenChunks {
            words: (0..chunks.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            chunks,
        }
    }

    /// Mark every chunk `len` bytes at `offset` touch.
    pub fn mark(&self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = offset / CHUNK_SIZE;
        let last = (offset.saturating_add(len) - 1) / CHUNK_SIZE;
        for c in first..=last.min(self.chunks.saturating_sub(1)) {
            let (w, bit) = ((c / 64) as usize, 1u64 << (c % 64));
            // Always the read-modify-write, also when the bit is set: it
            // publishes this writer's bytes before it reads the fence (see
            // `Volume::commit_write`).
            self.words[w].fetch_or(bit, Ordering::SeqCst);
        }
    }

    pub fn is_marked(&self, chunk: u64) -> bool {
        chunk < self.chunks
            && self.words[(chunk / 64) as usize].load(Ordering::SeqCst) & (1 << (chunk % 64)) != 0
    }

    pub fn count(&self) -> u64 {
        self.words
            .iter()
            .map(|w| u64::from(w.load(Ordering::SeqCst).count_ones()))
            .sum()
    }

    pub(super) fn clear(&self) {
        for w in self.words.iter() {
            w.store(0, Ordering::SeqCst);
        }
    }

    pub fn chunks(&self) -> u64 {
        self.chunks
    }
}
