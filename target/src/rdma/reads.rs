//! The RDMA READs a connection has posted: at most as many as the credits
//! the initiator granted (its ORD, lowered for illumos), each in a slot that
//! names it in its work request, each remembering its task and where its
//! bytes go. Pure bookkeeping, kept apart from the verbs so that the rules
//! the teardown and the aborts rely on are tested without an adapter.

use super::MAX_READ_CREDITS;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PendingRead {
    pub(super) tag: u32,
    pub(super) len: u32,
    /// The parameter-data buffer it reads into; `None`: LUN memory.
    pub(super) bounce: Option<u32>,
}

pub(super) struct ReadTable {
    slots: [Option<PendingRead>; MAX_READ_CREDITS],
    /// Posted and not completed.
    in_flight: usize,
    credits: usize,
}

impl ReadTable {
    /// A table for `credits` READs at once (at most `MAX_READ_CREDITS`).
    pub(super) fn new(credits: usize) -> ReadTable {
        ReadTable {
            slots: [None; MAX_READ_CREDITS],
            in_flight: 0,
            credits: credits.min(MAX_READ_CREDITS),
        }
    }

    /// Lower the credits (never raise them): READs already posted stay,
    /// and no new one is posted until they are below the new limit.
    pub(super) fn limit_credits(&mut self, max: usize) {
        self.credits = self.credits.min(max);
    }

    /// The slot a new READ may take, or `None` while every credit is used.
    pub(super) fn free_slot(&self) -> Option<usize> {
        if self.in_flight >= self.credits {
            return None;
        }
        self.slots.iter().position(Option::is_none)
    }

    /// Record `read` in `slot` before it is posted: should the post fail,
    /// the teardown still finds it (see [`reads_into_lun`](Self::reads_into_lun)).
    pub(super) fn record(&mut self, slot: usize, read: PendingRead) {
        self.slots[slot] = Some(read);
    }

    /// The READ recorded last was posted.
    pub(super) fn posted(&mut self) {
        self.in_flight += 1;
    }

    /// The READ of `slot` completed; `None` for a slot that holds none (a
    /// completion the connection never asked for).
    pub(super) fn complete(&mut self, slot: usize) -> Option<PendingRead> {
        let read = self.slots.get_mut(slot).and_then(Option::take)?;
        self.in_flight = self.in_flight.saturating_sub(1);
        Some(read)
    }

    pub(super) fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// READs into LUN memory still recorded: once the queue pair is
    /// destroyed they can no longer land, and the session's transfer count
    /// is lowered by this many.
    pub(super) fn reads_into_lun(&self) -> usize {
        self.slots
            .iter()
            .flatten()
            .filter(|r| r.bounce.is_none())
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(tag: u32, bounce: Option<u32>) -> PendingRead {
        PendingRead {
            tag,
            len: 4096,
            bounce,
        }
    }

    fn post(t: &mut ReadTable, r: PendingRead) -> usize {
        let slot = t.free_slot().expect("a free slot");
        t.record(slot, r);
        t.posted();
        slot
    }

    #[test]
    fn no_more_reads_than_credits() {
        let mut t = ReadTable::new(4);
        let slots: Vec<usize> = (0..4).map(|i| post(&mut t, read(i, None))).collect();
        assert_eq!(t.free_slot(), None, "a fifth READ beyond four credits");
        assert_eq!(t.complete(slots[2]), Some(read(2, None)));
        assert_eq!(
            t.free_slot(),
            Some(slots[2]),
            "the completed slot is reused"
        );
        assert_eq!(t.in_flight(), 3);
    }

    #[test]
    fn credits_never_exceed_the_table() {
        let mut t = ReadTable::new(1000);
        for i in 0..MAX_READ_CREDITS as u32 {
            post(&mut t, read(i, None));
        }
        assert_eq!(t.free_slot(), None);
    }

    /// The illumos limit learnt at login lowers the credits below what is
    /// already posted: nothing new until enough have completed.
    #[test]
    fn lowered_credits_hold_new_reads_until_enough_completed() {
        let mut t = ReadTable::new(8);
        let slots: Vec<usize> = (0..6).map(|i| post(&mut t, read(i, None))).collect();
        t.limit_credits(4);
        assert_eq!(t.free_slot(), None);
        t.complete(slots[0]);
        t.complete(slots[1]);
        assert_eq!(t.free_slot(), None, "4 in flight, 4 credits");
        t.complete(slots[2]);
        assert!(t.free_slot().is_some());
        t.limit_credits(16);
        post(&mut t, read(9, None));
        assert_eq!(t.free_slot(), None, "never raised: still four credits");
    }

    #[test]
    fn a_completion_for_an_empty_or_unknown_slot_is_none() {
        let mut t = ReadTable::new(4);
        let s = post(&mut t, read(1, None));
        assert!(t.complete(s).is_some());
        assert_eq!(t.complete(s), None, "completed twice");
        assert_eq!(t.complete(MAX_READ_CREDITS + 3), None, "beyond the table");
        assert_eq!(t.in_flight(), 0);
    }

    /// The teardown lowers the session's transfers by the READs into the
    /// LUN still recorded, posted or not (a failed post leaves it recorded);
    /// parameter-data READs are not transfers into the LUN.
    #[test]
    fn the_teardown_counts_every_read_into_the_lun_still_recorded() {
        let mut t = ReadTable::new(8);
        post(&mut t, read(1, None));
        post(&mut t, read(2, Some(0)));
        let done = post(&mut t, read(3, None));
        let failed = t.free_slot().expect("slot");
        t.record(failed, read(4, None));
        assert_eq!(t.in_flight(), 3, "the failed post is not in flight");
        assert_eq!(t.reads_into_lun(), 3);
        t.complete(done);
        assert_eq!(t.reads_into_lun(), 2);
    }
}
