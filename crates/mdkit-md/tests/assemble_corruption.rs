//! Acceptance (issue 15, items 1 and 3): 63 superblock, bitmap and bad-block-log field
//! corruptions of the *first* member of a raid1, raid5, raid6 and raid10 array, each through
//! (a) examine (the library reader `mdkit examine` uses) and (b) assembly. Checksums are
//! recomputed after an edit so the field validation is what catches it (a few cases leave the
//! checksum wrong on purpose).
//!
//! For every case: no panic; examine names the field (or shows a valid superblock when only the
//! comparison with the other members can tell); explicit assembly without `--run` refuses,
//! naming the member and the field; a degraded start leaves exactly that member out with that
//! reason, serves the data, and after stop the refused member is byte-identical while the
//! healthy members hold exactly the superblock state a normal degraded start (without the
//! member) writes: they are never marked stale.

use crate::array_util;

use std::sync::Arc;

use array_util::*;
use mdkit_io::{BlockDevice, MemDevice, Rng};
use mdkit_md::array::{AssembleOptions, PartialStart, assemble, assemble_with, read_superblock};
use mdkit_md::format::bitmap::off as bm;
use mdkit_md::format::examine::examine_member;
use mdkit_md::format::superblock::{MAX_DEV_ROLES, Superblock, feature, off, sb_checksum};
use mdkit_md::layout::Level;

const MEMBER_BYTES: u64 = 8 * MIB;

/// What examine must say about the damaged member.
#[derive(Clone, Copy, PartialEq)]
enum Seen {
    /// A problem naming the field.
    Problem,
    /// A problem, except on raid1 (which has no chunk or layout to check on its own): there
    /// only the comparison with the other members shows it.
    ProblemUnlessRaid1,
    /// A problem naming this (the assembly refusal names `Case::field`).
    ProblemNamed(&'static str),
    /// A valid superblock on its own: only assembly, comparing with the other members, can tell.
    Valid,
    /// No superblock can be shown at all; the error names the reason.
    Error,
}

enum Edit {
    /// Change decoded fields; the checksum is recomputed.
    Field(fn(&mut Superblock)),
    /// Change raw superblock bytes; `true` recomputes the checksum.
    Raw(fn(&mut [u8]), bool),
    /// Change raw bytes of the bitmap superblock.
    Bitmap(fn(&mut [u8])),
    /// Set BAD_BLOCKS and write this first log entry (raw on-disk u64).
    BadBlock(u64),
}

struct Case {
    name: &'static str,
    /// Text the examine problem and the assembly refusal must contain.
    field: &'static str,
    edit: Edit,
    seen: Seen,
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn cases() -> Vec<Case> {
    use Edit::*;
    use Seen::*;
    let c = |name, field, edit, seen| Case { name, field, edit, seen };
    vec![
        c("raid_disks huge", "raid_disks", Field(|s| s.raid_disks = 0x7fff_ffff), Problem),
        c("raid_disks zero", "raid_disks", Field(|s| s.raid_disks = 0), Problem),
        c("raid_disks above max_dev", "raid_disks", Field(|s| s.raid_disks = s.max_dev() + 1), Problem),
        c("dev_number all ones", "dev_number", Field(|s| s.dev_number = u32::MAX), Problem),
        c("dev_number 5000", "dev_number", Field(|s| s.dev_number = 5000), Problem),
        c("dev_number = max_dev", "dev_number", Field(|s| s.dev_number = s.max_dev()), Problem),
        c("max_dev zero", "dev_number", Field(|s| s.dev_roles.clear()), Problem),
        c("level 7", "level", Field(|s| s.level = 7), Problem),
        c("level huge", "level", Field(|s| s.level = i32::MAX), Problem),
        // raid1 records chunk 0: give it a value that differs from its members'.
        c("chunk zero", "chunksize", Field(|s| s.chunk_sectors = if s.level == 1 { 7 } else { 0 }), ProblemUnlessRaid1),
        c("chunk not a power of two", "chunksize", Field(|s| s.chunk_sectors = 3), ProblemUnlessRaid1),
        c("chunk all ones", "chunksize", Field(|s| s.chunk_sectors = u32::MAX), ProblemUnlessRaid1),
        c(
            "chunk valid but different",
            "chunksize",
            Field(|s| s.chunk_sectors = if s.chunk_sectors == 0 { 128 } else { s.chunk_sectors * 2 }),
            Valid,
        ),
        c("layout garbage", "layout", Field(|s| s.layout = u32::MAX), ProblemUnlessRaid1),
        c(
            "layout valid but different",
            "layout",
            Field(|s| {
                s.layout = match s.level {
                    5 | 6 => 0,
                    10 => 0x201,
                    _ => 1,
                }
            }),
            Valid,
        ),
        c("size all ones", "size", Field(|s| s.size_sectors = u64::MAX), Problem),
        c("size zero", "size", Field(|s| s.size_sectors = 0), Problem),
        c("size beyond data_size", "size", Field(|s| s.size_sectors = s.data_size_sectors + 8), Problem),
        // Valid on its own (a bitmap ahead of the size is what a grow cut after the bitmap
        // write leaves); assembly sees the members disagree on the size.
        c("size valid but smaller", "size", Field(|s| s.size_sectors -= 2048), Valid),
        c("ctime different", "ctime", Field(|s| s.ctime += 1), Valid),
        c("data_offset zero", "data_offset", Field(|s| s.data_offset_sectors = 0), Problem),
        c("data_offset beyond device", "data_size", Field(|s| s.data_offset_sectors = 1 << 40), Problem),
        c("data_size all ones", "data_size", Field(|s| s.data_size_sectors = u64::MAX), Problem),
        c("data_size tiny", "data_size", Field(|s| s.data_size_sectors = 5), Problem),
        c("data_size beyond device", "data_size", Field(|s| s.data_size_sectors = MEMBER_BYTES / 512), Problem),
        c("super_offset moved", "super_offset", Field(|s| s.super_offset_sectors = 0), Problem),
        c(
            "recovery_offset beyond data",
            "recovery_offset",
            Field(|s| {
                s.feature_map |= feature::RECOVERY_OFFSET;
                s.recovery_offset_sectors = u64::MAX;
            }),
            Problem,
        ),
        c("bitmap_offset zero", "bitmap_offset", Field(|s| s.bitmap_offset_raw = 0), Problem),
        c("bitmap_offset into the superblock", "bitmap_offset", Field(|s| s.bitmap_offset_raw = 1), Problem),
        c("bitmap_offset before the device", "bitmap_offset", Field(|s| s.bitmap_offset_raw = -100i32 as u32), Problem),
        c("bitmap_offset beyond the device", "bitmap_offset", Field(|s| s.bitmap_offset_raw = 0x7fff_ffff), Problem),
        c(
            "bitmap_offset into the data",
            "bitmap_offset",
            Field(|s| s.bitmap_offset_raw = (s.data_offset_sectors - s.super_offset_sectors + 8) as u32),
            Problem,
        ),
        c(
            "bblog_offset before the device",
            "bblog_offset",
            Field(|s| {
                s.bblog_size_sectors = 8;
                s.bblog_offset_sectors = -16;
            }),
            Problem,
        ),
        c(
            "bblog_offset beyond the device",
            "bblog_offset",
            Field(|s| {
                s.bblog_size_sectors = 8;
                s.bblog_offset_sectors = 0x7fff_0000;
            }),
            Problem,
        ),
        c(
            "bblog_offset into the superblock",
            "bblog_offset",
            Field(|s| {
                s.bblog_size_sectors = 8;
                s.bblog_offset_sectors = 2;
            }),
            Problem,
        ),
        c(
            "bblog_size 9",
            "bblog_size",
            Field(|s| {
                s.bblog_size_sectors = 9;
                s.bblog_offset_sectors = (s.data_offset_sectors - s.super_offset_sectors - 64) as i32;
            }),
            Problem,
        ),
        c("bblog_size all ones", "bblog_size", Field(|s| s.bblog_size_sectors = u16::MAX), Problem),
        c(
            "bad blocks without a log offset",
            "bblog_offset",
            Field(|s| {
                s.feature_map |= feature::BAD_BLOCKS;
                s.bblog_offset_sectors = 0;
            }),
            Problem,
        ),
        c(
            "bad blocks without a log",
            "bblog_size",
            Field(|s| {
                s.feature_map |= feature::BAD_BLOCKS;
                s.bblog_size_sectors = 0;
            }),
            Problem,
        ),
        c("RAID0_LAYOUT on another level", "RAID0_LAYOUT", Field(|s| s.feature_map |= feature::RAID0_LAYOUT), Problem),
        c("PPL with a bitmap", "PPL", Field(|s| s.feature_map |= feature::PPL), Problem),
        c("journal role without journal", "journal", Field(|s| s.dev_roles[s.dev_number as usize] = 0xfffd), Problem),
        // Its bitmap still carries the old uuid, which examine reports.
        c("foreign array uuid", "different array", Field(|s| s.set_uuid = [0xee; 16]), ProblemNamed("bitmap uuid")),
        c("unknown feature bit", "unknown feature bits", Raw(|b| b[off::FEATURE_MAP + 3] |= 0x80, true), Problem),
        c("pad0 not zero", "pad0", Raw(|b| b[off::PAD0] = 1, true), Problem),
        c("pad3 not zero", "pad3", Raw(|b| b[off::PAD3 + 5] = 1, true), Problem),
        c("max_dev 1921", "max_dev", Raw(|b| put32(b, off::MAX_DEV, MAX_DEV_ROLES + 1), true), Error),
        c("major_version 2", "major_version", Raw(|b| put32(b, off::MAJOR_VERSION, 2), true), Error),
        c("bad checksum: name", "checksum", Raw(|b| b[off::SET_NAME] ^= 0x20, false), Problem),
        c("bad checksum: events", "checksum", Raw(|b| b[off::EVENTS] ^= 1, false), Problem),
        c("bad checksum: raid_disks", "checksum", Raw(|b| put32(b, off::RAID_DISKS, 0x7fff_ffff), false), Problem),
        c("magic zeroed", "no md superblock", Raw(|b| put32(b, off::MAGIC, 0), false), Error),
        c("bad block beyond the device", "bad-block log", BadBlock((1 << 40) << 10 | 8), Problem),
        c("bad block of length zero", "bad-block log", BadBlock(4096 << 10), Problem),
        c("bitmap magic", "bitmap magic", Bitmap(|b| put32(b, bm::MAGIC, 0x1234)), Problem),
        c("bitmap version 7", "version 7", Bitmap(|b| put32(b, bm::VERSION, 7)), Problem),
        c("bitmap clustered", "clustered", Bitmap(|b| put32(b, bm::VERSION, 5)), Problem),
        c("bitmap chunk zero", "chunksize", Bitmap(|b| put32(b, bm::CHUNKSIZE, 0)), Problem),
        c("bitmap chunk not a power of two", "chunksize", Bitmap(|b| put32(b, bm::CHUNKSIZE, 1000)), Problem),
        c("bitmap chunk below 512", "chunksize", Bitmap(|b| put32(b, bm::CHUNKSIZE, 256)), Problem),
        c("bitmap daemon_sleep zero", "daemon_sleep", Bitmap(|b| put32(b, bm::DAEMON_SLEEP, 0)), Problem),
        c("bitmap write_behind", "write_behind", Bitmap(|b| put32(b, bm::WRITE_BEHIND, 20_000)), Problem),
        c("bitmap uuid", "uuid", Bitmap(|b| b[bm::UUID] ^= 0xff), Problem),
        c("bitmap sync_size", "sync_size", Bitmap(|b| put64(b, bm::SYNC_SIZE, u64::MAX)), Problem),
        // 512-byte chunks need more than the one reserved sector for their bits.
        c(
            "bitmap sectors_reserved",
            "sectors_reserved",
            Bitmap(|b| {
                put32(b, bm::CHUNKSIZE, 512);
                put32(b, bm::SECTORS_RESERVED, 1);
            }),
            Problem,
        ),
    ]
}

/// The array under test: its members' images after a clean stop, and the data it holds.
struct Fixture {
    level: Level,
    images: Vec<Arc<MemDevice>>,
    model: Model,
    written: Vec<(u64, u64)>,
    /// The healthy members' superblock state after a degraded start and stop without member 0.
    reference: Vec<SbState>,
}

/// What a start and stop write to a member's superblock (everything but the times and checksum).
type SbState = (u64, Vec<u16>, u64, u32, u64);

fn sb_state(sb: &Superblock) -> SbState {
    (sb.events, sb.dev_roles.clone(), sb.resync_offset_sectors, sb.feature_map, sb.recovery_offset_sectors)
}

fn prefix(level: Level) -> String {
    format!("{}-", level.name())
}

/// Fresh members with the fixture's contents.
fn copies(f: &Fixture) -> Vec<SimMember> {
    f.images
        .iter()
        .enumerate()
        .map(|(i, img)| {
            let name = format!("{}{i}", prefix(f.level));
            let mem = Arc::new(img.snapshot(name.clone()));
            SimMember { name, dev: mem.clone(), mem: Some(mem), fault: None }
        })
        .collect()
}

async fn healthy_states(ms: &[SimMember]) -> Vec<SbState> {
    let mut out = Vec::new();
    for m in &ms[1..] {
        out.push(sb_state(&read_superblock(&m.dev).await.unwrap_or_else(|e| panic!("{}: {e}", m.name))));
    }
    out
}

async fn verify_written(a: &dyn BlockDevice, f: &Fixture) {
    for (o, l) in &f.written {
        verify_range(a, &f.model, *o, *l).await;
    }
}

async fn fixture(level: Level, members: usize) -> Fixture {
    let mut rng = Rng::new(seed("assemble_corruption", 15));
    let ms = mem_members(&prefix(level), members, MEMBER_BYTES);
    let chunk = level.uses_chunks().then_some(64);
    let layout = (level == Level::Raid10).then_some(0x102);
    let a = create_array(&ms, opts(level, members as u32, chunk, layout, true, true)).await;
    let mut model = Model::new(a.size_bytes());
    let mut written = Vec::new();
    for _ in 0..24 {
        written.push(random_write(&a, &mut model, &mut rng, 64).await);
    }
    a.flush().await.unwrap();
    a.stop().await.unwrap();
    let images = ms.iter().map(|m| m.mem.clone().unwrap()).collect();
    let mut f = Fixture { level, images, model, written, reference: Vec::new() };
    // The normal degraded start: member 0 absent.
    let ms = copies(&f);
    let a = assemble(member_devs(&ms[1..]), AssembleOptions { name: "ref".into(), ..Default::default() })
        .await
        .unwrap_or_else(|e| panic!("{}: degraded start: {e}", level.name()));
    assert_eq!(a.refused, vec![]);
    verify_written(&a.array, &f).await;
    a.array.stop().await.unwrap();
    f.reference = healthy_states(&ms).await;
    f
}

fn apply(case: &Case, victim: &MemDevice) {
    let mut block = vec![0u8; 4096];
    victim.read_bytes(4096, &mut block);
    let sb = Superblock::decode(&block, 8).expect("fixture superblock is valid");
    match &case.edit {
        Edit::Field(edit) => {
            let mut s = sb.clone();
            edit(&mut s);
            victim.write_bytes(4096, &s.encode_unchecked());
        }
        Edit::Raw(edit, reseal) => {
            edit(&mut block);
            if *reseal {
                let max_dev = sb.max_dev().min(MAX_DEV_ROLES);
                let csum = sb_checksum(&block, max_dev);
                put32(&mut block, off::SB_CSUM, csum);
            }
            victim.write_bytes(4096, &block);
        }
        Edit::BadBlock(entry) => {
            let mut s = sb.clone();
            s.feature_map |= feature::BAD_BLOCKS;
            victim.write_bytes(4096, &s.encode_unchecked());
            let at = sb.bblog_sector().expect("fixture reserves a bad-block log") * 512;
            victim.write_bytes(at, &entry.to_le_bytes());
        }
        Edit::Bitmap(edit) => {
            let at = sb.bitmap_sector().expect("fixture has a bitmap") * 512;
            let mut b = vec![0u8; 256];
            victim.read_bytes(at, &mut b);
            edit(&mut b);
            victim.write_bytes(at, &b);
        }
    }
}

fn check_examine(f: &Fixture, case: &Case, victim: &MemDevice) {
    let mut read_at = |o: u64, buf: &mut [u8]| {
        victim.read_bytes(o, buf);
        Ok(())
    };
    let what = format!("{} / {}: examine", f.level.name(), case.name);
    let seen = match case.seen {
        Seen::ProblemUnlessRaid1 if f.level == Level::Raid1 => Seen::Valid,
        Seen::ProblemUnlessRaid1 => Seen::Problem,
        s => s,
    };
    match (examine_member(&mut read_at, MEMBER_BYTES / 512), seen) {
        (Err(e), Seen::Error) => assert!(e.to_lowercase().contains(case.field), "{what}: {e}"),
        (Err(e), _) => panic!("{what}: unexpected error {e}"),
        (Ok(m), Seen::Error) => panic!("{what}: expected an error, got {:?}", m.problems),
        (Ok(m), Seen::Valid) => assert_eq!(m.problems, Vec::<String>::new(), "{what}"),
        (Ok(m), seen) => {
            let field = if let Seen::ProblemNamed(f) = seen { f } else { case.field };
            assert!(m.problems.iter().any(|p| p.contains(field)), "{what}: {:?}", m.problems);
            // The damaged superblock still renders, without panicking.
            let ex = mdkit_md::format::examine::Examine::new(&m.lenient.superblock, m.bitmap.as_ref(), 16384);
            assert!(mdkit_md::format::examine::render(&ex).contains("Magic"));
            mdkit_md::format::examine::render_json_with(&ex);
        }
    }
}

async fn check_assembly(f: &Fixture, case: &Case, ms: &[SimMember]) {
    let what = format!("{} / {}", f.level.name(), case.name);
    let victim = ms[0].mem.clone().unwrap();
    let before = victim.snapshot("before");
    let opts = || AssembleOptions { name: "md-c".into(), ..Default::default() };
    // Explicit assembly without --run: refused, naming the member and the field.
    let e = assemble_with(member_devs(ms), opts(), PartialStart::NeedsRun).await.err().map(|e| e.to_string());
    let e = e.unwrap_or_else(|| panic!("{what}: started without --run"));
    assert!(e.contains(&ms[0].name) && e.contains(case.field) && e.contains("--run"), "{what}: {e}");
    // Degraded start: exactly the damaged member is left out, with the field in the reason.
    let a = assemble(member_devs(ms), opts()).await.unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(a.refused.len(), 1, "{what}: {:?}", a.refused);
    assert_eq!(a.refused[0].member, ms[0].name, "{what}: {:?}", a.refused);
    assert!(a.refused[0].reason.contains(case.field), "{what}: {}", a.refused[0]);
    assert_eq!(a.array.left_out(), a.refused, "{what}");
    assert_eq!(a.array.core().degraded(), 1, "{what}");
    verify_written(&a.array, f).await;
    a.array.stop().await.unwrap_or_else(|e| panic!("{what}: stop: {e}"));
    assert!(victim.same_contents(&before), "{what}: the refused member was written to");
    assert_eq!(healthy_states(ms).await, f.reference, "{what}: healthy members differ from a normal degraded start");
}

async fn run_level(level: Level, members: usize) {
    let f = fixture(level, members).await;
    let all = cases();
    assert!(all.len() >= 40);
    for case in &all {
        let ms = copies(&f);
        apply(case, ms[0].mem.as_ref().unwrap());
        check_examine(&f, case, ms[0].mem.as_ref().unwrap());
        check_assembly(&f, case, &ms).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid1_corrupt_first_member() {
    run_level(Level::Raid1, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_corrupt_first_member() {
    run_level(Level::Raid5, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid6_corrupt_first_member() {
    run_level(Level::Raid6, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid10_corrupt_first_member() {
    run_level(Level::Raid10, 4).await;
}
