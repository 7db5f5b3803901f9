//! Bitmap pages: the in-memory page images, the write rounds (group commit) and the member
//! I/O that writes them.
//!
//! # Rounds
//! One round counter for the whole bitmap, under a short lock taken only by requests that need
//! bitmap I/O (never by a write whose bits are already durable):
//! ```text
//!  join (under the lock):  change bits in the images; mark their pages wanted;
//!                          need = started + 1; wanted = max(wanted, need); start the writer if idle
//!  writer task, while started < wanted:
//!      (lock) started += 1, take the wanted pages and the FUA request   (unlock)
//!      snapshot those pages -> per member, one write per run of adjacent pages
//!      -> completed = started
//!  waiter: until completed >= need; Ok when a round >= need succeeded on some member
//! ```
//! A round's snapshot is taken after `started` moved past every request that joined before,
//! so it holds their bits; rounds never overlap, so the last completed write of a page is also
//! its newest content on every member. However many requests wait, and however many pages they
//! touch, a round costs one write per member per run of nearby pages (usually one: pages less
//! than `MERGE_GAP_PAGES` apart go in one write, the unchanged ones between them included).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::Poll;

use mdkit_io::{DeviceRef, IoBuf, SharedBuf, WriteFlags};
use parking_lot::Mutex;
use tokio::sync::watch;

use super::chunks::{ChunkState, new_block};
use super::{BitmapMember, Inner, PAGE_BYTES};
use crate::format::bitmap::{BITMAP_SUPER_BYTES, BITS_PER_PAGE};

/// A round writes wanted pages separated by at most this many other pages in one request.
const MERGE_GAP_PAGES: usize = 8;

/// Bit number (within the area) of chunk 0: the bits follow the 256-byte superblock.
pub(super) const FIRST_CHUNK_BIT: u64 = BITMAP_SUPER_BYTES as u64 * 8;

/// Where a chunk's bit and state live: (page, bit within the page).
pub(super) fn chunk_slot(chunk: u64) -> (usize, usize) {
    let bit = chunk + FIRST_CHUNK_BIT;
    ((bit / BITS_PER_PAGE) as usize, (bit % BITS_PER_PAGE) as usize)
}

/// The chunk whose bit is `bit` of page `page`.
pub(super) fn slot_chunk(page: usize, bit: usize) -> u64 {
    page as u64 * BITS_PER_PAGE + bit as u64 - FIRST_CHUNK_BIT
}

#[derive(Default)]
pub(super) struct Rounds {
    started: u64,
    wanted: u64,
    /// Pages the next round writes, ascending.
    pages: std::collections::BTreeSet<usize>,
    /// The next round must be FUA (someone waits for durability).
    fua: bool,
    /// Statistics: the next round sets bits (or only clears / writes the superblock).
    kind: Option<RoundKind>,
    writer_running: bool,
    /// Why the last failed round failed (for the waiters it leaves unserved).
    last_error: Option<(io::ErrorKind, String)>,
}

/// The round machinery of a bitmap (one per bitmap).
pub(super) struct RoundState {
    rounds: Mutex<Rounds>,
    done: watch::Sender<RoundsDone>,
}

impl Default for RoundState {
    fn default() -> RoundState {
        RoundState { rounds: Mutex::new(Rounds::default()), done: watch::channel(RoundsDone::default()).0 }
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RoundsDone {
    completed: u64,
    /// Newest round that reached at least one member.
    last_ok: u64,
}

/// One 4 KiB page of the bitmap area.
pub(super) struct Page {
    /// The page as the next write will carry it (little-endian words); on page 0 the first
    /// 32 words are the superblock's place and are replaced by the encoded header.
    pub words: Box<[AtomicU64]>,
    /// Chunk states for the chunks whose bits are in this page (indexed by bit), allocated on
    /// first use.
    pub chunks: OnceLock<Box<[AtomicU32]>>,
}

impl Page {
    pub fn new(bytes: &[u8]) -> Page {
        debug_assert_eq!(bytes.len(), PAGE_BYTES as usize);
        let words = bytes
            .chunks_exact(8)
            .map(|w| AtomicU64::new(u64::from_le_bytes(w.try_into().expect("8-byte chunks"))))
            .collect();
        Page { words, chunks: OnceLock::new() }
    }

    pub fn chunk_block(&self) -> &[AtomicU32] {
        self.chunks.get_or_init(|| new_block(BITS_PER_PAGE as usize))
    }

    #[cfg(test)]
    pub fn test_bit(&self, bit: usize) -> bool {
        self.words[bit / 64].load(Ordering::Acquire) & (1u64 << (bit % 64)) != 0
    }

    /// Sets a bit; returns whether it was clear.
    pub fn set_bit(&self, bit: usize) -> bool {
        let mask = 1u64 << (bit % 64);
        self.words[bit / 64].fetch_or(mask, Ordering::AcqRel) & mask == 0
    }

    pub fn clear_bit(&self, bit: usize) {
        self.words[bit / 64].fetch_and(!(1u64 << (bit % 64)), Ordering::AcqRel);
    }
}

//------------------------------------------------------------------------------------------------

/// One member's copy as the bitmap writes it.
pub(super) struct MemberIo {
    pub slot: u32,
    pub dev: DeviceRef,
    pub offset_bytes: u64,
    pub space_bytes: u64,
    /// A write or flush failed: reported once, no more I/O.
    pub failed: AtomicBool,
    /// Serialises the read-modify-write of a tail block shared with the next structure.
    pub tail_lock: Arc<tokio::sync::Mutex<()>>,
}

impl MemberIo {
    /// Checks a member's placement for a bitmap of `storage_bytes` in `pages` pages.
    pub fn new(m: BitmapMember, storage_bytes: u64, pages: u64, bitmap: &str) -> io::Result<MemberIo> {
        let name = m.dev.name().to_string();
        let fail =
            |why: String| io::Error::new(io::ErrorKind::InvalidData, format!("{bitmap}: bitmap on {name}: {why}"));
        if !m.bitmap_offset_bytes.is_multiple_of(PAGE_BYTES) {
            return Err(fail(format!(
                "starts at byte {}, not a multiple of 4 KiB (mdkit writes the bitmap in whole aligned 4 KiB pages)",
                m.bitmap_offset_bytes
            )));
        }
        if m.space_bytes < storage_bytes {
            return Err(fail(format!(
                "needs {storage_bytes} bytes but only {} are reserved before the next structure",
                m.space_bytes
            )));
        }
        let end = m.bitmap_offset_bytes.saturating_add(pages * PAGE_BYTES);
        let size = m.dev.topology().size_bytes;
        if end > size {
            return Err(fail(format!("its last 4 KiB page ends at byte {end}, beyond the device ({size} bytes)")));
        }
        Ok(MemberIo {
            slot: m.slot,
            dev: m.dev,
            offset_bytes: m.bitmap_offset_bytes,
            space_bytes: m.space_bytes,
            failed: AtomicBool::new(false),
            tail_lock: Arc::new(tokio::sync::Mutex::new(())),
        })
    }

    /// Whether the last of `pages` pages extends beyond the reserved space.
    pub fn tail_shared(&self, pages: u64) -> bool {
        pages * PAGE_BYTES > self.space_bytes
    }

    /// Writes pages `first..first + n` from `image` (n whole page images). Pages inside the
    /// reserved space go in one write (split at `max_io_bytes`); a last page reaching beyond the
    /// space is merged into the 4 KiB block read from the device (read-modify-write).
    async fn write_run(
        &self,
        first: u64,
        image: &SharedBuf,
        flags: WriteFlags,
        stats: &super::Stats,
    ) -> io::Result<()> {
        let n = image.len() as u64 / PAGE_BYTES;
        let inside = (self.space_bytes / PAGE_BYTES).saturating_sub(first).min(n);
        let max_pages = (u64::from(self.dev.topology().max_io_bytes) / PAGE_BYTES).max(1);
        let mut done = 0;
        while done < inside {
            let k = (inside - done).min(max_pages);
            let at = self.offset_bytes + (first + done) * PAGE_BYTES;
            let part = image.slice((done * PAGE_BYTES) as usize..((done + k) * PAGE_BYTES) as usize);
            self.dev.write(at, part, flags).await.map_err(|e| {
                let pages = match k {
                    1 => format!("page {}", first + done),
                    _ => format!("pages {}..{}", first + done, first + done + k),
                };
                io::Error::new(e.kind(), format!("{}: bitmap {pages} write at byte {at}: {e}", self.dev.name()))
            })?;
            stats.page_writes.fetch_add(1, Ordering::Relaxed);
            done += k;
        }
        if inside < n {
            debug_assert_eq!(inside + 1, n, "only the last page can reach beyond the space");
            let page = image.slice((inside * PAGE_BYTES) as usize..((inside + 1) * PAGE_BYTES) as usize);
            self.write_tail(first + inside, page, flags).await?;
            stats.page_writes.fetch_add(1, Ordering::Relaxed);
            stats.rmw_page_writes.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Read-modify-write of page `index`, whose 4 KiB block extends beyond the reserved space.
    async fn write_tail(&self, index: u64, image: SharedBuf, flags: WriteFlags) -> io::Result<()> {
        let rel = index * PAGE_BYTES;
        let at = self.offset_bytes + rel;
        let ctx = |e: io::Error, what: &str| {
            io::Error::new(e.kind(), format!("{}: bitmap page {index} {what} at byte {at}: {e}", self.dev.name()))
        };
        let ours = (self.space_bytes - rel) as usize;
        let _g = self.tail_lock.lock().await;
        let (mut block, r) = self.dev.read(at, IoBuf::uninit_contents(PAGE_BYTES as usize)).await;
        r.map_err(|e| ctx(e, "read (read-modify-write)"))?;
        if block.len() != PAGE_BYTES as usize {
            let short = io::Error::new(io::ErrorKind::UnexpectedEof, format!("short read: {} bytes", block.len()));
            return Err(ctx(short, "read (read-modify-write)"));
        }
        block.as_mut_slice()[..ours].copy_from_slice(&image.as_slice()[..ours]);
        self.dev.write(at, block.freeze(), flags).await.map_err(|e| ctx(e, "write (read-modify-write)"))
    }
}

//------------------------------------------------------------------------------------------------

/// Polls every future to completion concurrently; results in input order.
pub(super) async fn join_all<F: Future>(futs: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut futs: Vec<Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *o = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending { Poll::Pending } else { Poll::Ready(()) }
    })
    .await;
    out.into_iter().map(|o| o.expect("every future completed")).collect()
}

/// What a round is for (statistics only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RoundKind {
    Set,
    Clear,
    Header,
}

impl Inner {
    /// The state of `chunk`, allocating its page's block on first use.
    pub(super) fn chunk_state_alloc(&self, chunk: u64) -> &AtomicU32 {
        let (p, bit) = chunk_slot(chunk);
        &self.pages[p].chunk_block()[bit]
    }

    /// The state of `chunk` if its page's block exists.
    pub(super) fn chunk_state(&self, chunk: u64) -> Option<&AtomicU32> {
        let (p, bit) = chunk_slot(chunk);
        self.pages.get(p)?.chunks.get().map(|b| &b[bit])
    }

    /// Calls `f` for every chunk whose bit is set in the page images, ascending.
    pub(super) fn for_each_dirty(&self, mut f: impl FnMut(u64)) {
        let chunks = self.chunks();
        for (p, page) in self.pages.iter().enumerate() {
            for (w, word) in page.words.iter().enumerate() {
                let mut bits = word.load(Ordering::Acquire);
                if p == 0 && (w as u64) < FIRST_CHUNK_BIT / 64 {
                    continue;
                }
                while bits != 0 {
                    let b = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let c = slot_chunk(p, w * 64 + b);
                    if c >= chunks {
                        return;
                    }
                    f(c);
                }
            }
        }
    }

    /// Takes a pending count on `chunk` (resetting its age); returns whether its bit was
    /// already durable. Waits (yielding) while the chunk has the maximum of pending writes.
    pub(super) async fn begin_chunk(&self, chunk: u64) -> bool {
        let state = self.chunk_state_alloc(chunk);
        let mut old = state.load(Ordering::Acquire);
        loop {
            if ChunkState::pending(old) >= ChunkState::PENDING_MAX {
                tokio::task::yield_now().await;
                old = state.load(Ordering::Acquire);
                continue;
            }
            let new = ChunkState::with_age(old, 0) + 1;
            match state.compare_exchange_weak(old, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    self.account(chunk, old, new);
                    return old & ChunkState::DURABLE != 0;
                }
                Err(cur) => old = cur,
            }
        }
    }

    /// Sets the bits of `chunks` (each holding a pending count), joins the next FUA round,
    /// waits, then marks them durable.
    pub(super) async fn make_durable(self: &Arc<Self>, chunks: &[u64]) -> io::Result<()> {
        let need = self.join_round(true, RoundKind::Set, |pages, wanted| {
            for &c in chunks {
                let (p, bit) = chunk_slot(c);
                if pages[p].set_bit(bit) {
                    self.stats.bits_set.fetch_add(1, Ordering::Relaxed);
                }
                wanted.insert(p);
            }
            true
        });
        if let Some(need) = need {
            self.wait_round(need).await?;
        }
        for &c in chunks {
            let state = self.chunk_state_alloc(c);
            // Pending > 0 both before and after: no idle-dirty accounting.
            state.fetch_or(ChunkState::DURABLE, Ordering::AcqRel);
        }
        Ok(())
    }

    /// Under the round lock runs `mark`, which changes page images, adds the pages to write to
    /// the set and says whether it needs a round; if so, joins the next round (starting the
    /// writer when idle).
    /// Returns the round to wait for.
    pub(super) fn join_round(
        self: &Arc<Self>,
        fua: bool,
        kind: RoundKind,
        mark: impl FnOnce(&[Page], &mut std::collections::BTreeSet<usize>) -> bool,
    ) -> Option<u64> {
        let mut r = self.rounds.rounds.lock();
        let mut wanted = std::mem::take(&mut r.pages);
        let needed = mark(&self.pages, &mut wanted);
        r.pages = wanted;
        if !needed {
            return None;
        }
        let need = r.started + 1;
        r.wanted = r.wanted.max(need);
        r.fua |= fua;
        r.kind = Some(match (r.kind, kind) {
            (Some(RoundKind::Set), _) | (_, RoundKind::Set) => RoundKind::Set,
            (Some(RoundKind::Clear), _) | (_, RoundKind::Clear) => RoundKind::Clear,
            _ => RoundKind::Header,
        });
        if !r.writer_running {
            r.writer_running = true;
            let me = self.clone();
            self.spawn(async move { me.write_rounds().await });
        }
        Some(need)
    }

    /// Joins a round writing pages `pages` as they are (superblock updates, new members).
    pub(super) fn join_round_pages(self: &Arc<Self>, pages: impl IntoIterator<Item = usize>, fua: bool) -> u64 {
        let pages: Vec<usize> = pages.into_iter().collect();
        self.join_round(fua, RoundKind::Header, |_, wanted| {
            wanted.extend(pages.iter().copied());
            true
        })
        .expect("a round with pages to write")
    }

    /// Waits until round `need` (or a later one) completed; `Err` when none of them reached a
    /// member.
    pub(super) async fn wait_round(&self, need: u64) -> io::Result<()> {
        let mut rx = self.rounds.done.subscribe();
        let done = match rx.wait_for(|d| d.completed >= need).await {
            Ok(d) => *d,
            Err(_) => return Err(self.io_error(io::ErrorKind::BrokenPipe, "bitmap writer is gone")),
        };
        if done.last_ok >= need {
            return Ok(());
        }
        let (kind, why) =
            self.rounds.rounds.lock().last_error.clone().unwrap_or((io::ErrorKind::Other, "unknown error".into()));
        Err(self.io_error(kind, format!("could not be written to any member: {why}")))
    }

    /// The writer task: runs rounds while requests wait.
    async fn write_rounds(self: Arc<Self>) {
        loop {
            let (round, pages, fua, kind) = {
                let mut r = self.rounds.rounds.lock();
                if r.started >= r.wanted {
                    r.writer_running = false;
                    return;
                }
                r.started += 1;
                (r.started, std::mem::take(&mut r.pages), std::mem::take(&mut r.fua), r.kind.take())
            };
            match kind {
                Some(RoundKind::Set) => &self.stats.set_rounds,
                Some(RoundKind::Clear) => &self.stats.clear_rounds,
                _ => &self.stats.header_rounds,
            }
            .fetch_add(1, Ordering::Relaxed);
            let result = self.write_pages_everywhere(&pages, fua).await;
            let ok = result.is_ok();
            if let Err(e) = result {
                tracing::warn!("{e}");
                self.rounds.rounds.lock().last_error = Some((e.kind(), e.to_string()));
            }
            self.rounds.done.send_modify(|d| {
                d.completed = round;
                if ok {
                    d.last_ok = round;
                }
            });
        }
    }

    /// A snapshot of pages `first..first + n` as they go to disk (page 0 with the encoded
    /// superblock).
    pub(super) fn pages_image(&self, first: usize, n: usize) -> io::Result<SharedBuf> {
        let mut buf = IoBuf::uninit_contents(n * PAGE_BYTES as usize);
        for (i, dst_page) in buf.as_mut_slice().chunks_exact_mut(PAGE_BYTES as usize).enumerate() {
            for (dst, w) in dst_page.chunks_exact_mut(8).zip(self.pages[first + i].words.iter()) {
                dst.copy_from_slice(&w.load(Ordering::Acquire).to_le_bytes());
            }
        }
        if first == 0 {
            let header = self.header.lock().clone();
            header.write_header(buf.as_mut_slice()).map_err(|e| {
                self.io_error(io::ErrorKind::InvalidData, format!("refusing to write the bitmap superblock: {e}"))
            })?;
        }
        Ok(buf.freeze())
    }

    /// Writes `pages` (ascending) to every working member, one write per run of adjacent pages;
    /// members that fail are reported and dropped from later rounds. `Ok` when at least one
    /// member took every page.
    pub(super) async fn write_pages_everywhere(
        &self,
        pages: &std::collections::BTreeSet<usize>,
        fua: bool,
    ) -> io::Result<()> {
        let mut runs: Vec<(usize, SharedBuf)> = Vec::new();
        let mut it = pages.iter().copied().peekable();
        while let Some(first) = it.next() {
            // Pages in small gaps go along (their current image is always safe to write): one
            // larger write costs less than several small ones on every member.
            let mut end = first + 1;
            while let Some(&p) = it.peek() {
                if p - end > MERGE_GAP_PAGES {
                    break;
                }
                end = p + 1;
                it.next();
            }
            runs.push((first, self.pages_image(first, end - first)?));
        }
        let members = self.members_snapshot();
        let active: Vec<&Arc<MemberIo>> = members.iter().filter(|m| !m.failed.load(Ordering::Acquire)).collect();
        if active.is_empty() {
            return Err(self.io_error(io::ErrorKind::NotConnected, "no working member to write the bitmap to"));
        }
        let flags = if fua { WriteFlags::FUA } else { WriteFlags::NONE };
        let results = join_all(active.iter().map(|m| {
            let runs = &runs;
            async move {
                for (first, image) in runs {
                    m.write_run(*first as u64, image, flags, &self.stats).await?;
                }
                Ok::<(), io::Error>(())
            }
        }))
        .await;
        let mut ok = 0usize;
        let mut failures = Vec::new();
        let mut last_err = None;
        for (m, r) in active.iter().zip(results) {
            match r {
                Ok(()) => ok += 1,
                Err(e) => {
                    if !m.failed.swap(true, Ordering::AcqRel) {
                        failures.push((m.slot, io::Error::new(e.kind(), e.to_string())));
                    }
                    last_err = Some(e);
                }
            }
        }
        for (slot, e) in &failures {
            tracing::warn!("{}: bitmap write failed on slot {slot}, failing the member: {e}", self.name);
            (self.on_member_error)(*slot, e);
        }
        match (ok, last_err) {
            (0, Some(e)) => Err(e),
            _ => Ok(()),
        }
    }

    /// Flushes every working member; a failure is reported (the member is failed) and makes
    /// the whole call fail (a sweep must not clear bits on the strength of it).
    pub(super) async fn flush_members(&self) -> io::Result<()> {
        let members = self.members_snapshot();
        let active: Vec<&Arc<MemberIo>> = members.iter().filter(|m| !m.failed.load(Ordering::Acquire)).collect();
        if active.is_empty() {
            return Err(self.io_error(io::ErrorKind::NotConnected, "no working member to flush"));
        }
        let results = join_all(active.iter().map(|m| m.dev.flush())).await;
        self.stats.member_flushes.fetch_add(active.len() as u64, Ordering::Relaxed);
        let mut failures = Vec::new();
        for (m, r) in active.iter().zip(results) {
            if let Err(e) = r {
                let e = io::Error::new(e.kind(), format!("{}: flush before clearing bitmap bits: {e}", m.dev.name()));
                if !m.failed.swap(true, Ordering::AcqRel) {
                    failures.push((m.slot, e));
                } else {
                    failures.push((u32::MAX, e));
                }
            }
        }
        drop(members);
        let mut first = None;
        for (slot, e) in failures {
            if slot != u32::MAX {
                (self.on_member_error)(slot, &e);
            }
            first.get_or_insert(e);
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Writes page 0 (the bitmap superblock) durably everywhere and waits.
    pub(super) async fn write_header(self: &Arc<Self>) -> io::Result<()> {
        let need = self.join_round_pages([0], true);
        self.wait_round(need).await
    }

    /// Writes every page durably everywhere and waits.
    pub(super) async fn write_all_pages(self: &Arc<Self>) -> io::Result<()> {
        let need = self.join_round_pages(0..self.pages.len(), true);
        self.wait_round(need).await
    }

    /// Replaces the member set; new members get every page in the background.
    pub(super) fn set_members(self: &Arc<Self>, members: Vec<BitmapMember>) {
        let old = self.members_snapshot();
        let mut next = Vec::with_capacity(members.len());
        let mut added = false;
        let mut refused = Vec::new();
        for m in members {
            let same = |o: &&Arc<MemberIo>| {
                o.slot == m.slot
                    && std::ptr::addr_eq(Arc::as_ptr(&o.dev), Arc::as_ptr(&m.dev))
                    && o.offset_bytes == m.bitmap_offset_bytes
                    && !o.failed.load(Ordering::Acquire)
            };
            if let Some(o) = old.iter().find(same) {
                next.push(o.clone());
                continue;
            }
            let slot = m.slot;
            match MemberIo::new(m, self.geo.storage_bytes(), self.geo.pages(), &self.name) {
                Ok(io) => {
                    next.push(Arc::new(io));
                    added = true;
                }
                Err(e) => refused.push((slot, e)),
            }
        }
        *self.members.write() = Arc::new(next);
        for (slot, e) in refused {
            tracing::warn!("{e}");
            (self.on_member_error)(slot, &e);
        }
        if added {
            let me = self.clone();
            self.spawn(async move {
                if let Err(e) = me.write_all_pages().await {
                    tracing::warn!("{}: writing the bitmap to new members: {e}", me.name);
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_slots_follow_the_kernel_bit_numbering() {
        assert_eq!(chunk_slot(0), (0, 2048));
        assert_eq!(chunk_slot(30_719), (0, 32_767));
        assert_eq!(chunk_slot(30_720), (1, 0));
        for c in [0u64, 1, 30_719, 30_720, 1 << 20] {
            let (p, b) = chunk_slot(c);
            assert_eq!(slot_chunk(p, b), c);
        }
    }

    #[test]
    fn page_words_are_little_endian_bytes() {
        let mut bytes = vec![0u8; PAGE_BYTES as usize];
        bytes[256 + 1] = 0b10; // chunk 9
        let page = Page::new(&bytes);
        assert!(page.test_bit(2048 + 9));
        assert!(!page.test_bit(2048 + 8));
        assert!(page.set_bit(2048 + 8));
        assert!(!page.set_bit(2048 + 8));
        page.clear_bit(2048 + 9);
        assert!(!page.test_bit(2048 + 9));
    }
}
