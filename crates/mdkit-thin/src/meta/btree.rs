//! Persistent-data btrees (kernel dm-btree layout), copy-on-write through the transaction
//! manager, with reference-counted sharing of subtrees.
//!
//! ```text
//! node (salt 121107):
//!   0 csum u32 | 4 flags u32 (1 internal, 2 leaf) | 8 blocknr u64 | 16 nr_entries u32
//!   20 max_entries u32 | 24 value_size u32 | 28 padding u32
//!   32 keys: u64 x max_entries | values: value_size x max_entries
//! ```
//! Invariants kept by every operation (and checked by thin_check): keys strictly ascending
//! within a node and across leaves; an internal key is <= the first key of its child; every
//! non-root node holds at least max_entries / 3 entries; max_entries is a multiple of 3.
//!
//! Insert descends shadowing the path and splits full nodes on the way back up (each half gets
//! at least half the entries). Remove descends shadowing the path and, on the way back up,
//! repairs a child that fell below the minimum by merging it with a sibling (when both fit in
//! one node) or by redistributing the pair evenly; a root left with a single child is replaced
//! by that child. Shadowing a node that was shared adds one reference to each of its children
//! (internal nodes) or values (leaves, through [`ValueRc`]).

use crate::meta::block::{BLOCK_SIZE, BlockBuf, BlockKind, get_u32, get_u64, put_u32, put_u64};
use crate::meta::error::{BlockPath, Corruption, MetaError, Result};
use crate::meta::tm::{BlockRef, Tm};

pub const NODE_HEADER_BYTES: usize = 32;
pub const INTERNAL_NODE: u32 = 1;
pub const LEAF_NODE: u32 = 2;
/// Deeper than any tree that fits the largest metadata device; reaching it means a cycle.
pub const MAX_DEPTH: usize = 32;
/// Largest value stored by any tree of this engine (device details).
pub const MAX_VALUE_BYTES: usize = 24;

const OFF_FLAGS: usize = 4;
const OFF_NR_ENTRIES: usize = 16;
const OFF_MAX_ENTRIES: usize = 20;
const OFF_VALUE_SIZE: usize = 24;

/// Kernel calc_max_entries: as many key+value pairs as fit, rounded down to a multiple of 3.
pub const fn calc_max_entries(value_size: usize) -> u32 {
    let total = (BLOCK_SIZE - NODE_HEADER_BYTES) / (8 + value_size);
    (total / 3 * 3) as u32
}

const _: () = assert!(calc_max_entries(8) == 252);
const _: () = assert!(calc_max_entries(24) == 126);
const _: () = assert!(calc_max_entries(16) == 168);
const _: () = assert!(calc_max_entries(4) == 336);

/// A value copied out of a node (at most [`MAX_VALUE_BYTES`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Value {
    len: u8,
    bytes: [u8; MAX_VALUE_BYTES],
}

impl Value {
    pub fn new(v: &[u8]) -> Value {
        assert!(v.len() <= MAX_VALUE_BYTES, "value of {} bytes", v.len());
        let mut bytes = [0u8; MAX_VALUE_BYTES];
        bytes[..v.len()].copy_from_slice(v);
        Value { len: v.len() as u8, bytes }
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    pub fn as_u64(&self) -> u64 {
        get_u64(self.as_slice(), 0)
    }
}

impl std::fmt::Debug for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Value({:02x?})", self.as_slice())
    }
}

/// Reference-count hooks for leaf values that point at something (data blocks, subtrees).
pub(crate) trait ValueRc {
    /// Size of the values the hooks decode; `None` if they look at no value. Every write path
    /// refuses a leaf of another value size before it hands the leaf's values to the hooks.
    fn value_size(&self) -> Option<usize>;
    fn inc(&mut self, tm: &mut Tm, value: &[u8]) -> Result<()>;
    fn dec(&mut self, tm: &mut Tm, value: &[u8]) -> Result<()>;
}

/// Values that reference nothing.
pub(crate) struct NoRc;

impl ValueRc for NoRc {
    fn value_size(&self) -> Option<usize> {
        None
    }
    fn inc(&mut self, _: &mut Tm, _: &[u8]) -> Result<()> {
        Ok(())
    }
    fn dec(&mut self, _: &mut Tm, _: &[u8]) -> Result<()> {
        Ok(())
    }
}

//------------------------------------------------------------------------------------------------
// Node layout

/// Read-only view of a node's fields (the block was validated when it was read).
#[derive(Clone, Copy)]
pub struct NodeView<'a> {
    b: &'a BlockBuf,
}

impl<'a> NodeView<'a> {
    pub fn new(b: &'a BlockBuf) -> NodeView<'a> {
        NodeView { b }
    }
    pub fn flags(&self) -> u32 {
        get_u32(self.b, OFF_FLAGS)
    }
    pub fn is_leaf(&self) -> bool {
        self.flags() & LEAF_NODE != 0
    }
    pub fn nr_entries(&self) -> u32 {
        get_u32(self.b, OFF_NR_ENTRIES)
    }
    pub fn max_entries(&self) -> u32 {
        get_u32(self.b, OFF_MAX_ENTRIES)
    }
    pub fn value_size(&self) -> u32 {
        get_u32(self.b, OFF_VALUE_SIZE)
    }
    pub fn key(&self, i: usize) -> u64 {
        get_u64(self.b, NODE_HEADER_BYTES + 8 * i)
    }
    fn value_off(&self, i: usize) -> usize {
        NODE_HEADER_BYTES + 8 * self.max_entries() as usize + self.value_size() as usize * i
    }
    pub fn value(&self, i: usize) -> &'a [u8] {
        let off = self.value_off(i);
        &self.b[off..off + self.value_size() as usize]
    }
    pub fn value_u64(&self, i: usize) -> u64 {
        get_u64(self.b, self.value_off(i))
    }
    /// Index of the last key <= `key`, or None when every key is greater.
    pub fn lower_bound(&self, key: u64) -> Option<usize> {
        let (mut lo, mut hi) = (0usize, self.nr_entries() as usize);
        // Find the first key > key.
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.key(mid) <= key {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo.checked_sub(1)
    }
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.nr_entries() as usize).map(|i| self.key(i))
    }
}

/// Structural validation of a node, independent of which tree it belongs to.
pub fn validate_node(b: &BlockBuf) -> Result<(), Corruption> {
    let n = NodeView::new(b);
    let flags = n.flags();
    if flags != INTERNAL_NODE && flags != LEAF_NODE {
        return Err(Corruption::BadNodeHeader(format!("flags {flags:#x} are neither internal (1) nor leaf (2)")));
    }
    let vs = n.value_size() as usize;
    // Every tree of dm-thin stores values of at most 24 bytes; anything else is not ours.
    if vs == 0 || vs > MAX_VALUE_BYTES {
        return Err(Corruption::BadNodeHeader(format!("value_size {vs}")));
    }
    if flags == INTERNAL_NODE && vs != 8 {
        return Err(Corruption::ValueSizeMismatch { expected: 8, found: vs as u32 });
    }
    let max = n.max_entries() as usize;
    if max == 0 || !max.is_multiple_of(3) || NODE_HEADER_BYTES + max * (8 + vs) > BLOCK_SIZE {
        return Err(Corruption::BadNodeHeader(format!("max_entries {max} impossible for value_size {vs}")));
    }
    let nr = n.nr_entries();
    if nr as usize > max {
        return Err(Corruption::TooManyEntries { nr_entries: nr, max_entries: max as u32 });
    }
    if flags == INTERNAL_NODE && nr == 0 {
        return Err(Corruption::BadNodeHeader("internal node without entries".into()));
    }
    for i in 1..nr as usize {
        let (prev, key) = (n.key(i - 1), n.key(i));
        if key <= prev {
            return Err(Corruption::KeysOutOfOrder { index: i as u32, prev, key });
        }
    }
    Ok(())
}

/// A decoded node for restructuring (split / merge / redistribute).
#[derive(Clone)]
struct OwnedNode {
    flags: u32,
    max_entries: u32,
    value_size: usize,
    keys: Vec<u64>,
    values: Vec<u8>,
}

impl OwnedNode {
    fn decode(b: &BlockBuf) -> OwnedNode {
        let n = NodeView::new(b);
        let nr = n.nr_entries() as usize;
        let vs = n.value_size() as usize;
        let start = n.value_off(0);
        OwnedNode {
            flags: n.flags(),
            max_entries: n.max_entries(),
            value_size: vs,
            keys: (0..nr).map(|i| n.key(i)).collect(),
            values: b[start..start + nr * vs].to_vec(),
        }
    }

    fn len(&self) -> usize {
        self.keys.len()
    }

    fn encode(&self, b: &mut BlockBuf) {
        assert!(self.len() <= self.max_entries as usize, "encoding an overfull node");
        b.fill(0);
        put_u32(b, OFF_FLAGS, self.flags);
        put_u32(b, OFF_NR_ENTRIES, self.len() as u32);
        put_u32(b, OFF_MAX_ENTRIES, self.max_entries);
        put_u32(b, OFF_VALUE_SIZE, self.value_size as u32);
        for (i, k) in self.keys.iter().enumerate() {
            put_u64(b, NODE_HEADER_BYTES + 8 * i, *k);
        }
        let start = NODE_HEADER_BYTES + 8 * self.max_entries as usize;
        b[start..start + self.values.len()].copy_from_slice(&self.values);
    }

    fn insert(&mut self, pos: usize, key: u64, value: &[u8]) {
        assert_eq!(value.len(), self.value_size);
        self.keys.insert(pos, key);
        let at = pos * self.value_size;
        self.values.splice(at..at, value.iter().copied());
    }

    /// Moves entries `[at..)` into a new node.
    fn split_off(&mut self, at: usize) -> OwnedNode {
        OwnedNode {
            flags: self.flags,
            max_entries: self.max_entries,
            value_size: self.value_size,
            keys: self.keys.split_off(at),
            values: self.values.split_off(at * self.value_size),
        }
    }

    fn append(&mut self, mut other: OwnedNode) {
        self.keys.append(&mut other.keys);
        self.values.append(&mut other.values);
    }
}

fn set_nr_entries(b: &mut BlockBuf, nr: u32) {
    put_u32(b, OFF_NR_ENTRIES, nr);
}

fn set_key(b: &mut BlockBuf, i: usize, key: u64) {
    put_u64(b, NODE_HEADER_BYTES + 8 * i, key);
}

fn set_value(b: &mut BlockBuf, i: usize, value: &[u8]) {
    let off = NodeView::new(b).value_off(i);
    b[off..off + value.len()].copy_from_slice(value);
}

/// Inserts at `pos` in a node that has room.
fn insert_at(b: &mut BlockBuf, pos: usize, key: u64, value: &[u8]) {
    let n = NodeView::new(b);
    let nr = n.nr_entries() as usize;
    let vs = n.value_size() as usize;
    assert!(nr < n.max_entries() as usize && pos <= nr && value.len() == vs, "insert_at precondition");
    let (v0, vend) = (n.value_off(pos), n.value_off(nr));
    let k0 = NODE_HEADER_BYTES + 8 * pos;
    b.copy_within(k0..NODE_HEADER_BYTES + 8 * nr, k0 + 8);
    b.copy_within(v0..vend, v0 + vs);
    set_key(b, pos, key);
    b[v0..v0 + vs].copy_from_slice(value);
    set_nr_entries(b, nr as u32 + 1);
}

/// Deletes entries `[from, to)`.
fn delete_range(b: &mut BlockBuf, from: usize, to: usize) {
    let n = NodeView::new(b);
    let nr = n.nr_entries() as usize;
    assert!(from <= to && to <= nr, "delete_range precondition");
    let count = to - from;
    if count == 0 {
        return;
    }
    let (v_from, v_to, v_end) = (n.value_off(from), n.value_off(to), n.value_off(nr));
    b.copy_within(NODE_HEADER_BYTES + 8 * to..NODE_HEADER_BYTES + 8 * nr, NODE_HEADER_BYTES + 8 * from);
    b.copy_within(v_to..v_end, v_from);
    set_nr_entries(b, (nr - count) as u32);
}

//------------------------------------------------------------------------------------------------
// Reading helpers

/// How a lookup may obtain blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadMode {
    /// Read from the device when a block is not in memory.
    MayRead,
    /// Fail with `WouldBlock` instead (fast path, never blocks on I/O).
    CacheOnly,
}

fn read_node<'t>(tm: &'t Tm, b: u64, mode: ReadMode) -> Result<BlockRef<'t>> {
    match mode {
        ReadMode::MayRead => tm.read(b, BlockKind::Node),
        ReadMode::CacheOnly => tm.read_cached(b, BlockKind::Node)?.ok_or(MetaError::WouldBlock { block: b }),
    }
}

/// Per-access checks that depend on the tree: leaf value size.
fn check_node(tm: &Tm, b: u64, n: NodeView<'_>, leaf_value_size: usize) -> Result<()> {
    if n.is_leaf() && n.value_size() as usize != leaf_value_size {
        return Err(
            tm.corrupt(b, Corruption::ValueSizeMismatch { expected: leaf_value_size as u32, found: n.value_size() })
        );
    }
    Ok(())
}

/// Child `i` of internal node `b`, refusing references past the device or back up the path.
fn child_of(tm: &Tm, b: u64, n: NodeView<'_>, i: usize, path: &[u64]) -> Result<u64> {
    let c = n.value_u64(i);
    let reason = if c >= tm.nr_blocks() {
        Corruption::BeyondDevice { target: c, nr_blocks: tm.nr_blocks() }
    } else if c == b || path.contains(&c) {
        Corruption::Cycle
    } else {
        return Ok(c);
    };
    Err(MetaError::Corrupt { device: tm.name().to_string(), block: b, path: BlockPath(path.to_vec()), reason })
}

fn with_path(e: MetaError, path: &[u64]) -> MetaError {
    e.with_path_prefix(path)
}

fn too_deep(tm: &Tm, b: u64, path: &[u64]) -> MetaError {
    MetaError::Corrupt {
        device: tm.name().to_string(),
        block: b,
        path: BlockPath(path.to_vec()),
        reason: Corruption::TooDeep { depth: MAX_DEPTH },
    }
}

//------------------------------------------------------------------------------------------------
// Operations

/// A new empty tree (one empty leaf).
pub(crate) fn empty(tm: &mut Tm, value_size: usize) -> Result<u64> {
    let b = tm.new_block(BlockKind::Node)?;
    let node = OwnedNode {
        flags: LEAF_NODE,
        max_entries: calc_max_entries(value_size),
        value_size,
        keys: Vec::new(),
        values: Vec::new(),
    };
    node.encode(tm.get_mut(b)?);
    Ok(b)
}

/// Looks `key` up in one level.
pub(crate) fn lookup(tm: &Tm, root: u64, key: u64, value_size: usize, mode: ReadMode) -> Result<Option<Value>> {
    let mut b = root;
    let mut path = [0u64; MAX_DEPTH];
    for depth in 0..MAX_DEPTH {
        path[depth] = b;
        let blk = read_node(tm, b, mode).map_err(|e| with_path(e, &path[..depth]))?;
        let n = NodeView::new(&blk);
        check_node(tm, b, n, value_size).map_err(|e| with_path(e, &path[..depth]))?;
        let Some(i) = n.lower_bound(key) else { return Ok(None) };
        if n.is_leaf() {
            return Ok((n.key(i) == key).then(|| Value::new(n.value(i))));
        }
        b = child_of(tm, b, n, i, &path[..depth])?;
    }
    Err(too_deep(tm, b, &path))
}

/// The first entry with key >= `key`.
pub(crate) fn lookup_ge(tm: &Tm, root: u64, key: u64, value_size: usize) -> Result<Option<(u64, Value)>> {
    fn rec(tm: &Tm, b: u64, key: u64, vs: usize, path: &mut Vec<u64>) -> Result<Option<(u64, Value)>> {
        if path.len() >= MAX_DEPTH {
            return Err(too_deep(tm, b, path));
        }
        let blk = tm.read(b, BlockKind::Node).map_err(|e| with_path(e, path))?;
        let n = NodeView::new(&blk);
        check_node(tm, b, n, vs).map_err(|e| with_path(e, path))?;
        let nr = n.nr_entries() as usize;
        if n.is_leaf() {
            let start = match n.lower_bound(key) {
                Some(i) if n.key(i) == key => i,
                Some(i) => i + 1,
                None => 0,
            };
            return Ok((start < nr).then(|| (n.key(start), Value::new(n.value(start)))));
        }
        let start = n.lower_bound(key).unwrap_or(0);
        for i in start..nr {
            let child = child_of(tm, b, n, i, path)?;
            path.push(b);
            let r = rec(tm, child, key, vs, path);
            path.pop();
            if let Some(r) = r? {
                return Ok(Some(r));
            }
        }
        Ok(None)
    }
    rec(tm, root, key, value_size, &mut Vec::new())
}

/// Visits entries with `begin <= key < end` in key order; `f` returns false to stop.
pub(crate) fn walk_range(
    tm: &Tm,
    root: u64,
    value_size: usize,
    begin: u64,
    end: u64,
    f: &mut dyn FnMut(u64, &[u8]) -> Result<bool>,
) -> Result<()> {
    fn rec(
        tm: &Tm,
        b: u64,
        vs: usize,
        begin: u64,
        end: u64,
        path: &mut Vec<u64>,
        f: &mut dyn FnMut(u64, &[u8]) -> Result<bool>,
    ) -> Result<bool> {
        if path.len() >= MAX_DEPTH {
            return Err(too_deep(tm, b, path));
        }
        let blk = tm.read(b, BlockKind::Node).map_err(|e| with_path(e, path))?;
        let n = NodeView::new(&blk);
        check_node(tm, b, n, vs).map_err(|e| with_path(e, path))?;
        let nr = n.nr_entries() as usize;
        if n.is_leaf() {
            for i in 0..nr {
                let k = n.key(i);
                if k >= end {
                    return Ok(false);
                }
                if k >= begin && !f(k, n.value(i))? {
                    return Ok(false);
                }
            }
            return Ok(true);
        }
        let start = n.lower_bound(begin).unwrap_or(0);
        for i in start..nr {
            if n.key(i) >= end {
                return Ok(false);
            }
            let child = child_of(tm, b, n, i, path)?;
            path.push(b);
            let r = rec(tm, child, vs, begin, end, path, f);
            path.pop();
            if !r? {
                return Ok(false);
            }
        }
        Ok(true)
    }
    rec(tm, root, value_size, begin, end, &mut Vec::new(), f).map(|_| ())
}

/// Refuses a leaf whose values `rc` would misread (their size is not the one it decodes).
fn check_values_for(tm: &Tm, b: u64, n: NodeView<'_>, rc: &dyn ValueRc) -> Result<()> {
    match rc.value_size() {
        Some(vs) => check_node(tm, b, n, vs),
        None => Ok(()),
    }
}

/// Shadows `b` for modification, adding references to its children if it was shared. A leaf
/// whose value size `rc` does not decode is refused first, so nothing has changed: every write
/// path shadows each node it touches, so this also guards the values it later removes.
fn shadow_node(tm: &mut Tm, rc: &mut dyn ValueRc, b: u64) -> Result<u64> {
    check_values_for(tm, b, NodeView::new(&*tm.read(b, BlockKind::Node)?), rc)?;
    // The copy was validated when the original was read from the device.
    let (loc, was_shared) = tm.shadow(b, BlockKind::Node)?;
    if was_shared {
        inc_children(tm, rc, loc)?;
    }
    Ok(loc)
}

fn inc_children(tm: &mut Tm, rc: &mut dyn ValueRc, loc: u64) -> Result<()> {
    let node = OwnedNode::decode(&*tm.read(loc, BlockKind::Node)?);
    if node.flags == INTERNAL_NODE {
        for c in node.values.chunks_exact(8) {
            tm.inc(get_u64(c, 0))?;
        }
    } else {
        for v in node.values.chunks_exact(node.value_size) {
            rc.inc(tm, v)?;
        }
    }
    Ok(())
}

fn node_of(tm: &Tm, loc: u64) -> Result<OwnedNode> {
    Ok(OwnedNode::decode(&*tm.read(loc, BlockKind::Node)?))
}

/// Result of inserting below a node: its (possibly new) location, a new right sibling created
/// by a split, and the value that was replaced.
struct InsertOutcome {
    loc: u64,
    split: Option<(u64, u64)>,
    old: Option<Value>,
}

/// Inserts or overwrites `key`. Returns the new root and the replaced value, if any. The
/// replaced value is *not* released: the caller decides (`rc.dec`) because it knows whether
/// the new value took over the old one's reference.
pub(crate) fn insert(
    tm: &mut Tm,
    rc: &mut dyn ValueRc,
    root: u64,
    key: u64,
    value: &[u8],
) -> Result<(u64, Option<Value>)> {
    let out = insert_rec(tm, rc, root, key, value, 0)?;
    let Some((right_key, right_loc)) = out.split else { return Ok((out.loc, out.old)) };
    // The root split: grow a level.
    let left_key = node_of(tm, out.loc)?.keys[0];
    let new_root = tm.new_block(BlockKind::Node)?;
    let mut values = Vec::with_capacity(16);
    values.extend_from_slice(&out.loc.to_le_bytes());
    values.extend_from_slice(&right_loc.to_le_bytes());
    let node = OwnedNode {
        flags: INTERNAL_NODE,
        max_entries: calc_max_entries(8),
        value_size: 8,
        keys: vec![left_key, right_key],
        values,
    };
    node.encode(tm.get_mut(new_root)?);
    Ok((new_root, out.old))
}

fn insert_rec(
    tm: &mut Tm,
    rc: &mut dyn ValueRc,
    b: u64,
    key: u64,
    value: &[u8],
    depth: usize,
) -> Result<InsertOutcome> {
    if depth >= MAX_DEPTH {
        return Err(too_deep(tm, b, &[]));
    }
    let loc = shadow_node(tm, rc, b)?;
    let (is_leaf, nr, max, pos) = {
        let blk = tm.read(loc, BlockKind::Node)?;
        let n = NodeView::new(&blk);
        check_node(tm, loc, n, value.len())?;
        (n.is_leaf(), n.nr_entries() as usize, n.max_entries() as usize, n.lower_bound(key))
    };
    if is_leaf {
        if let Some(i) = pos {
            let existing = node_of_key(tm, loc, i)?;
            if existing.0 == key {
                set_value(tm.get_mut(loc)?, i, value);
                return Ok(InsertOutcome { loc, split: None, old: Some(existing.1) });
            }
        }
        let at = pos.map_or(0, |i| i + 1);
        let split = insert_or_split(tm, loc, nr, max, at, key, value)?;
        return Ok(InsertOutcome { loc, split, old: None });
    }
    let i = match pos {
        Some(i) => i,
        None => {
            // New smallest key: lower the bound of the first child.
            set_key(tm.get_mut(loc)?, 0, key);
            0
        }
    };
    let i = if make_room_in_child(tm, rc, loc, i, key)? {
        // Entries moved between two children: find the one for `key` again.
        NodeView::new(&*tm.read(loc, BlockKind::Node)?).lower_bound(key).unwrap_or(0)
    } else {
        i
    };
    let child = NodeView::new(&*tm.read(loc, BlockKind::Node)?).value_u64(i);
    let below = insert_rec(tm, rc, child, key, value, depth + 1).map_err(|e| with_path(e, &[loc]))?;
    set_value(tm.get_mut(loc)?, i, &below.loc.to_le_bytes());
    let split = match below.split {
        None => None,
        Some((rk, rloc)) => insert_or_split(tm, loc, nr, max, i + 1, rk, &rloc.to_le_bytes())?,
    };
    Ok(InsertOutcome { loc, split, old: below.old })
}

/// A sibling must have at least this many free entries to be worth sharing with (kernel
/// SPACE_THRESHOLD).
const SPACE_THRESHOLD: u32 = 8;

/// Before descending into a full child, move entries into an unshared sibling that has room
/// (the kernel's rebalance_left / rebalance_right). Splitting only when both siblings are full
/// (or shared) keeps nodes nearly full for sequential inserts, instead of half full.
/// Returns true if entries moved.
fn make_room_in_child(tm: &mut Tm, rc: &mut dyn ValueRc, parent: u64, i: usize, key: u64) -> Result<bool> {
    let (child, nr_parent) = {
        let blk = tm.read(parent, BlockKind::Node)?;
        let n = NodeView::new(&blk);
        (n.value_u64(i), n.nr_entries() as usize)
    };
    let (c_flags, c_max) = {
        let blk = tm.read(child, BlockKind::Node)?;
        let n = NodeView::new(&blk);
        let full = n.nr_entries() >= n.max_entries();
        let overwrite = n.is_leaf() && n.lower_bound(key).is_some_and(|j| n.key(j) == key);
        if !full || overwrite {
            return Ok(false);
        }
        (n.flags(), n.max_entries())
    };
    let candidates = [i.checked_sub(1), (i + 1 < nr_parent).then_some(i + 1)];
    for sib in candidates.into_iter().flatten() {
        let sib_b = NodeView::new(&*tm.read(parent, BlockKind::Node)?).value_u64(sib);
        if tm.ref_count(sib_b) > 1 {
            continue; // shared with a snapshot: copying it would cost more than it saves
        }
        let room = {
            let blk = tm.read(sib_b, BlockKind::Node)?;
            let n = NodeView::new(&blk);
            n.flags() == c_flags && n.max_entries() == c_max && n.max_entries() - n.nr_entries() >= SPACE_THRESHOLD
        };
        if !room {
            continue;
        }
        let c_loc = shadow_node(tm, rc, child)?;
        let s_loc = shadow_node(tm, rc, sib_b)?;
        {
            let p = tm.get_mut(parent)?;
            set_value(p, i, &c_loc.to_le_bytes());
            set_value(p, sib, &s_loc.to_le_bytes());
        }
        let (ri, l_loc, r_loc) = if sib < i { (i, s_loc, c_loc) } else { (sib, c_loc, s_loc) };
        let (left, right) = redistribute(node_of(tm, l_loc)?, node_of(tm, r_loc)?);
        left.encode(tm.get_mut(l_loc)?);
        right.encode(tm.get_mut(r_loc)?);
        set_key(tm.get_mut(parent)?, ri, right.keys[0]);
        return Ok(true);
    }
    Ok(false)
}

/// Splits the entries of two adjacent nodes evenly between them.
fn redistribute(mut left: OwnedNode, mut right: OwnedNode) -> (OwnedNode, OwnedNode) {
    let total = left.len() + right.len();
    let target_left = total / 2;
    if left.len() > target_left {
        let mut moved = left.split_off(target_left);
        moved.append(right);
        right = moved;
    } else {
        let take = target_left - left.len();
        let rest = right.split_off(take);
        left.append(right);
        right = rest;
    }
    (left, right)
}

fn node_of_key(tm: &Tm, loc: u64, i: usize) -> Result<(u64, Value)> {
    let blk = tm.read(loc, BlockKind::Node)?;
    let n = NodeView::new(&blk);
    Ok((n.key(i), Value::new(n.value(i))))
}

/// Inserts into `loc` (holding `nr` of `max` entries); splits it in two when full and returns
/// the new right sibling's first key and location.
fn insert_or_split(
    tm: &mut Tm,
    loc: u64,
    nr: usize,
    max: usize,
    at: usize,
    key: u64,
    value: &[u8],
) -> Result<Option<(u64, u64)>> {
    if nr < max {
        insert_at(tm.get_mut(loc)?, at, key, value);
        return Ok(None);
    }
    let mut left = node_of(tm, loc)?;
    left.insert(at, key, value);
    let right = left.split_off(left.len() / 2);
    let right_loc = tm.new_block(BlockKind::Node)?;
    left.encode(tm.get_mut(loc)?);
    right.encode(tm.get_mut(right_loc)?);
    Ok(Some((right.keys[0], right_loc)))
}

/// Removes `key`; returns the new root and the removed value, which has already been released
/// through `rc.dec`.
pub(crate) fn remove(tm: &mut Tm, rc: &mut dyn ValueRc, root: u64, key: u64) -> Result<(u64, Option<Value>)> {
    if !lookup_any(tm, root, key)? {
        return Ok((root, None));
    }
    let mut removed = Vec::new();
    let loc = remove_run_rec(tm, rc, root, key, key.saturating_add(1), 0, &mut removed)?;
    let new_root = collapse_root(tm, loc)?;
    for (_, v) in &removed {
        rc.dec(tm, v.as_slice())?;
    }
    Ok((new_root, removed.first().map(|(_, v)| *v)))
}

/// Removes every key in `[begin, end)`; returns the new root and how many entries went.
/// `sink` sees each removed entry before its value is released.
pub(crate) fn remove_range(
    tm: &mut Tm,
    rc: &mut dyn ValueRc,
    root: u64,
    value_size: usize,
    begin: u64,
    end: u64,
    sink: &mut dyn FnMut(u64, Value),
) -> Result<(u64, u64)> {
    let mut root = root;
    let mut count = 0u64;
    let mut from = begin;
    while from < end {
        let Some((k, _)) = lookup_ge(tm, root, from, value_size)? else { break };
        if k >= end {
            break;
        }
        let mut removed = Vec::new();
        let loc = remove_run_rec(tm, rc, root, k, end, 0, &mut removed)?;
        root = collapse_root(tm, loc)?;
        if removed.is_empty() {
            // lookup_ge found the key but the descent did not: keys are out of order
            // across nodes.
            return Err(
                tm.corrupt(root, Corruption::KeyRangeViolation(format!("key {k} is not where the tree's keys lead")))
            );
        }
        count += removed.len() as u64;
        for (key, v) in &removed {
            sink(*key, *v);
            rc.dec(tm, v.as_slice())?;
        }
        from = k;
    }
    Ok((root, count))
}

fn lookup_any(tm: &Tm, root: u64, key: u64) -> Result<bool> {
    let mut b = root;
    for _ in 0..MAX_DEPTH {
        let blk = tm.read(b, BlockKind::Node)?;
        let n = NodeView::new(&blk);
        let Some(i) = n.lower_bound(key) else { return Ok(false) };
        if n.is_leaf() {
            return Ok(n.key(i) == key);
        }
        b = n.value_u64(i);
    }
    Err(too_deep(tm, b, &[]))
}

/// Descends towards `first` (which is present) and deletes the run of keys `[first, end)` from
/// the leaf that holds `first`, repairing underfull nodes on the way back.
fn remove_run_rec(
    tm: &mut Tm,
    rc: &mut dyn ValueRc,
    b: u64,
    first: u64,
    end: u64,
    depth: usize,
    removed: &mut Vec<(u64, Value)>,
) -> Result<u64> {
    if depth >= MAX_DEPTH {
        return Err(too_deep(tm, b, &[]));
    }
    let loc = shadow_node(tm, rc, b)?;
    let (is_leaf, pos, nr) = {
        let blk = tm.read(loc, BlockKind::Node)?;
        let n = NodeView::new(&blk);
        (n.is_leaf(), n.lower_bound(first), n.nr_entries() as usize)
    };
    if is_leaf {
        let blk = tm.read(loc, BlockKind::Node)?;
        let n = NodeView::new(&blk);
        let Some(start) = pos.filter(|&i| n.key(i) == first) else { return Ok(loc) };
        let mut stop = start;
        while stop < nr && n.key(stop) < end {
            removed.push((n.key(stop), Value::new(n.value(stop))));
            stop += 1;
        }
        drop(blk);
        delete_range(tm.get_mut(loc)?, start, stop);
        return Ok(loc);
    }
    let Some(i) = pos else { return Ok(loc) };
    let child = NodeView::new(&*tm.read(loc, BlockKind::Node)?).value_u64(i);
    let child_loc = remove_run_rec(tm, rc, child, first, end, depth + 1, removed).map_err(|e| with_path(e, &[loc]))?;
    set_value(tm.get_mut(loc)?, i, &child_loc.to_le_bytes());
    let (child_nr, child_max) = {
        let blk = tm.read(child_loc, BlockKind::Node)?;
        let n = NodeView::new(&blk);
        (n.nr_entries(), n.max_entries())
    };
    if child_nr < child_max / 3 {
        fix_underflow(tm, rc, loc, i)?;
    }
    Ok(loc)
}

/// Child `i` of `parent` (both new) has too few entries: merge it with a sibling or share the
/// sibling's entries.
fn fix_underflow(tm: &mut Tm, rc: &mut dyn ValueRc, parent: u64, i: usize) -> Result<()> {
    let (nr_parent, li) = {
        let blk = tm.read(parent, BlockKind::Node)?;
        let n = NodeView::new(&blk);
        let nr = n.nr_entries() as usize;
        (nr, if i > 0 { i - 1 } else { 0 })
    };
    if nr_parent < 2 {
        return Ok(()); // a root with one child; collapse_root handles it
    }
    let ri = li + 1;
    let (l_old, r_old) = {
        let blk = tm.read(parent, BlockKind::Node)?;
        let n = NodeView::new(&blk);
        (n.value_u64(li), n.value_u64(ri))
    };
    let l_loc = shadow_node(tm, rc, l_old)?;
    let r_loc = shadow_node(tm, rc, r_old)?;
    {
        let p = tm.get_mut(parent)?;
        set_value(p, li, &l_loc.to_le_bytes());
        set_value(p, ri, &r_loc.to_le_bytes());
    }
    let mut left = node_of(tm, l_loc)?;
    let right = node_of(tm, r_loc)?;
    if left.flags != right.flags || left.value_size != right.value_size || left.max_entries != right.max_entries {
        return Err(tm.corrupt(r_loc, Corruption::BadNodeHeader("sibling nodes of different shapes".into())));
    }
    let max = left.max_entries as usize;
    if left.len() + right.len() <= max {
        left.append(right);
        left.encode(tm.get_mut(l_loc)?);
        delete_range(tm.get_mut(parent)?, ri, ri + 1);
        // The right node's references now belong to the left node: free only the block.
        tm.dec(r_loc)?;
    } else {
        let (left, right) = redistribute(left, right);
        left.encode(tm.get_mut(l_loc)?);
        right.encode(tm.get_mut(r_loc)?);
        set_key(tm.get_mut(parent)?, ri, right.keys[0]);
    }
    Ok(())
}

/// Replaces an internal root that has a single child by the child.
fn collapse_root(tm: &mut Tm, mut loc: u64) -> Result<u64> {
    for _ in 0..MAX_DEPTH {
        let (is_leaf, nr, child) = {
            let blk = tm.read(loc, BlockKind::Node)?;
            let n = NodeView::new(&blk);
            (n.is_leaf(), n.nr_entries(), if n.nr_entries() > 0 { n.value_u64(0) } else { 0 })
        };
        if is_leaf || nr != 1 {
            return Ok(loc);
        }
        if tm.ref_count(loc) > 1 {
            tm.inc(child)?;
        }
        tm.dec(loc)?;
        loc = child;
    }
    Err(too_deep(tm, loc, &[]))
}

/// Shadows the path to existing `key` and returns (new root, leaf, index) so the caller can
/// rewrite the value in place with [`set_leaf_value`].
pub(crate) fn shadow_path(tm: &mut Tm, rc: &mut dyn ValueRc, root: u64, key: u64) -> Result<Option<(u64, u64, usize)>> {
    let mut b = root;
    let mut parent: Option<(u64, usize)> = None;
    let mut new_root = root;
    for _ in 0..MAX_DEPTH {
        let loc = shadow_node(tm, rc, b)?;
        match parent {
            Some((p, pi)) => set_value(tm.get_mut(p)?, pi, &loc.to_le_bytes()),
            None => new_root = loc,
        }
        let (is_leaf, pos) = {
            let blk = tm.read(loc, BlockKind::Node)?;
            let n = NodeView::new(&blk);
            let pos = n.lower_bound(key);
            (n.is_leaf(), pos.map(|i| (i, n.key(i), if n.is_leaf() { 0 } else { n.value_u64(i) })))
        };
        let Some((i, k, child)) = pos else { return Ok(None) };
        if is_leaf {
            return Ok((k == key).then_some((new_root, loc, i)));
        }
        parent = Some((loc, i));
        b = child;
    }
    Err(too_deep(tm, b, &[]))
}

pub(crate) fn leaf_value(tm: &Tm, leaf: u64, i: usize) -> Result<Value> {
    Ok(node_of_key(tm, leaf, i)?.1)
}

/// Overwrites a value in a leaf returned by [`shadow_path`] (no reference counting).
pub(crate) fn set_leaf_value(tm: &mut Tm, leaf: u64, i: usize, value: &[u8]) -> Result<()> {
    set_value(tm.get_mut(leaf)?, i, value);
    Ok(())
}

/// Drops one reference to the tree at `root`; nodes (and values, through `rc`) whose count
/// reaches zero are released.
pub(crate) fn del(tm: &mut Tm, rc: &mut dyn ValueRc, root: u64) -> Result<()> {
    let mut stack = vec![root];
    while let Some(b) = stack.pop() {
        if tm.ref_count(b) > 1 {
            tm.dec(b)?;
            continue;
        }
        let node = {
            let blk = tm.read(b, BlockKind::Node)?;
            check_values_for(tm, b, NodeView::new(&blk), rc)?;
            OwnedNode::decode(&blk)
        };
        tm.dec(b)?;
        if node.flags == INTERNAL_NODE {
            stack.extend(node.values.chunks_exact(8).map(|c| get_u64(c, 0)));
        } else {
            for v in node.values.chunks_exact(node.value_size) {
                rc.dec(tm, v)?;
            }
        }
    }
    Ok(())
}

/// The largest key in the tree.
pub(crate) fn last_key(tm: &Tm, root: u64) -> Result<Option<u64>> {
    let mut b = root;
    for _ in 0..MAX_DEPTH {
        let blk = tm.read(b, BlockKind::Node)?;
        let n = NodeView::new(&blk);
        let nr = n.nr_entries() as usize;
        if nr == 0 {
            return Ok(None);
        }
        if n.is_leaf() {
            return Ok(Some(n.key(nr - 1)));
        }
        b = n.value_u64(nr - 1);
    }
    Err(too_deep(tm, b, &[]))
}

#[cfg(test)]
mod tests;
