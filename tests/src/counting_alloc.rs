//! A global allocator that counts allocations, to show that a path makes
//! none per I/O once warmed up. The target's `zero_alloc` test and the iSER
//! initiator check both install it:
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOCATOR: CountingAllocator = CountingAllocator::new();
//! let before = ALLOCATOR.allocations();
//! ```
// A global allocator is an unsafe trait; this is the one implementation.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting `alloc` and `realloc` calls.
pub struct CountingAllocator {
    allocations: AtomicUsize,
}

impl CountingAllocator {
    pub const fn new() -> CountingAllocator {
        CountingAllocator {
            allocations: AtomicUsize::new(0),
        }
    }

    /// Allocations (and reallocations) so far, in every thread.
    pub fn allocations(&self) -> usize {
        self.allocations.load(Ordering::Relaxed)
    }
}

impl Default for CountingAllocator {
    fn default() -> Self {
        CountingAllocator::new()
    }
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.allocations.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is System.alloc's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from System.alloc/realloc with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        self.allocations.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is System.realloc's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_allocations_and_reallocations() {
        let counter = CountingAllocator::new();
        let layout = Layout::from_size_align(64, 8).unwrap();
        // SAFETY: a valid layout; the block is freed with the same layout.
        unsafe {
            let p = counter.alloc(layout);
            assert!(!p.is_null());
            let q = counter.realloc(p, layout, 128);
            assert!(!q.is_null());
            counter.dealloc(q, Layout::from_size_align(128, 8).unwrap());
        }
        assert_eq!(counter.allocations(), 2);
    }
}
