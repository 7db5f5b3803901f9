//! What a power cut must keep: the crash tests record each acknowledged write and each
//! completed flush by their positions in the crash group's log, and judge a cut point by them.

/// One acknowledged write and the log position when its acknowledgement was seen.
pub struct Written {
    pub off: u64,
    pub data: Vec<u8>,
    pub fua: bool,
    pub acked_at: u64,
}

/// A completed array flush: log positions before it was issued and after it returned.
pub struct Flushed {
    pub started_at: u64,
    pub done_at: u64,
}

/// Whether `w` must survive a cut at `point`: acknowledged by then, and either FUA or
/// acknowledged before a flush started that completed by then.
pub fn durable(w: &Written, flushes: &[Flushed], point: u64) -> bool {
    w.acked_at <= point && (w.fua || flushes.iter().any(|f| f.done_at <= point && w.acked_at <= f.started_at))
}
