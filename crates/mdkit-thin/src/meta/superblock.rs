//! The thin-pool superblock (block 0; kernel struct thin_disk_superblock).
//!
//! ```text
//!   0 csum u32 (salt 160774)   4 flags u32 (bit 0 NEEDS_CHECK)   8 blocknr u64 (= 0)
//!  16 uuid [16]               32 magic u64 = 27022010           40 version u32 (1 or 2)
//!  44 time u32                48 trans_id u64                   56 held_root u64
//!  64 data_space_map_root [128]          192 metadata_space_map_root [128]
//! 320 data_mapping_root u64  328 device_details_root u64
//! 336 data_block_size u32 (sectors)      340 metadata_block_size u32 (sectors, 8)
//! 344 metadata_nr_blocks u64 352 compat_flags u32  356 compat_ro_flags u32  360 incompat_flags u32
//! ```

use crate::meta::block::{BLOCK_SECTORS, BlockBuf, get_u32, get_u64, put_u32, put_u64};
use crate::meta::error::Corruption;
use crate::meta::sm_format::SmRoot;

pub const THIN_MAGIC: u64 = 27_022_010;
/// Version written by this engine (and by the kernel since 3.x).
pub const THIN_VERSION: u32 = 2;
pub const FLAG_NEEDS_CHECK: u32 = 1;
pub const SUPERBLOCK_LOCATION: u64 = 0;
/// Data block size limits in sectors (64 KiB .. 1 GiB, multiples of 64 KiB).
pub const MIN_DATA_BLOCK_SECTORS: u32 = 128;
pub const MAX_DATA_BLOCK_SECTORS: u32 = 2_097_152;

const OFF_FLAGS: usize = 4;
const OFF_UUID: usize = 16;
const OFF_MAGIC: usize = 32;
const OFF_VERSION: usize = 40;
const OFF_TIME: usize = 44;
const OFF_TRANS_ID: usize = 48;
const OFF_HELD_ROOT: usize = 56;
const OFF_DATA_SM_ROOT: usize = 64;
const OFF_METADATA_SM_ROOT: usize = 192;
const SM_ROOT_FIELD_BYTES: usize = 128;
const OFF_DATA_MAPPING_ROOT: usize = 320;
const OFF_DEVICE_DETAILS_ROOT: usize = 328;
const OFF_DATA_BLOCK_SIZE: usize = 336;
const OFF_METADATA_BLOCK_SIZE: usize = 340;
const OFF_METADATA_NR_BLOCKS: usize = 344;
const OFF_COMPAT_FLAGS: usize = 352;
const OFF_COMPAT_RO_FLAGS: usize = 356;
const OFF_INCOMPAT_FLAGS: usize = 360;
/// Bytes after the last field are zero.
pub const SUPERBLOCK_BYTES: usize = 364;

const _: () = assert!(OFF_METADATA_SM_ROOT == OFF_DATA_SM_ROOT + SM_ROOT_FIELD_BYTES);
const _: () = assert!(OFF_DATA_MAPPING_ROOT == OFF_METADATA_SM_ROOT + SM_ROOT_FIELD_BYTES);
const _: () = assert!(SUPERBLOCK_BYTES < 512, "live fields must fit one sector for atomic update");

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub flags: u32,
    pub uuid: [u8; 16],
    pub magic: u64,
    pub version: u32,
    pub time: u32,
    pub trans_id: u64,
    pub held_root: u64,
    pub data_sm_root: SmRoot,
    pub metadata_sm_root: SmRoot,
    pub data_mapping_root: u64,
    pub device_details_root: u64,
    pub data_block_size_sectors: u32,
    pub metadata_block_size_sectors: u32,
    pub metadata_nr_blocks: u64,
    pub compat_flags: u32,
    pub compat_ro_flags: u32,
    pub incompat_flags: u32,
}

impl Superblock {
    /// Decodes the fields (checksum and location are verified by the caller).
    pub fn unpack(b: &BlockBuf) -> Superblock {
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[OFF_UUID..OFF_UUID + 16]);
        Superblock {
            flags: get_u32(b, OFF_FLAGS),
            uuid,
            magic: get_u64(b, OFF_MAGIC),
            version: get_u32(b, OFF_VERSION),
            time: get_u32(b, OFF_TIME),
            trans_id: get_u64(b, OFF_TRANS_ID),
            held_root: get_u64(b, OFF_HELD_ROOT),
            data_sm_root: SmRoot::unpack(&b[OFF_DATA_SM_ROOT..OFF_DATA_SM_ROOT + SM_ROOT_FIELD_BYTES]),
            metadata_sm_root: SmRoot::unpack(&b[OFF_METADATA_SM_ROOT..OFF_METADATA_SM_ROOT + SM_ROOT_FIELD_BYTES]),
            data_mapping_root: get_u64(b, OFF_DATA_MAPPING_ROOT),
            device_details_root: get_u64(b, OFF_DEVICE_DETAILS_ROOT),
            data_block_size_sectors: get_u32(b, OFF_DATA_BLOCK_SIZE),
            metadata_block_size_sectors: get_u32(b, OFF_METADATA_BLOCK_SIZE),
            metadata_nr_blocks: get_u64(b, OFF_METADATA_NR_BLOCKS),
            compat_flags: get_u32(b, OFF_COMPAT_FLAGS),
            compat_ro_flags: get_u32(b, OFF_COMPAT_RO_FLAGS),
            incompat_flags: get_u32(b, OFF_INCOMPAT_FLAGS),
        }
    }

    /// Encodes into a zeroed block (checksum and location are sealed by the writer).
    pub fn pack(&self, b: &mut BlockBuf) {
        b.fill(0);
        put_u32(b, OFF_FLAGS, self.flags);
        b[OFF_UUID..OFF_UUID + 16].copy_from_slice(&self.uuid);
        put_u64(b, OFF_MAGIC, self.magic);
        put_u32(b, OFF_VERSION, self.version);
        put_u32(b, OFF_TIME, self.time);
        put_u64(b, OFF_TRANS_ID, self.trans_id);
        put_u64(b, OFF_HELD_ROOT, self.held_root);
        self.data_sm_root.pack(&mut b[OFF_DATA_SM_ROOT..OFF_DATA_SM_ROOT + SM_ROOT_FIELD_BYTES]);
        self.metadata_sm_root.pack(&mut b[OFF_METADATA_SM_ROOT..OFF_METADATA_SM_ROOT + SM_ROOT_FIELD_BYTES]);
        put_u64(b, OFF_DATA_MAPPING_ROOT, self.data_mapping_root);
        put_u64(b, OFF_DEVICE_DETAILS_ROOT, self.device_details_root);
        put_u32(b, OFF_DATA_BLOCK_SIZE, self.data_block_size_sectors);
        put_u32(b, OFF_METADATA_BLOCK_SIZE, self.metadata_block_size_sectors);
        put_u64(b, OFF_METADATA_NR_BLOCKS, self.metadata_nr_blocks);
        put_u32(b, OFF_COMPAT_FLAGS, self.compat_flags);
        put_u32(b, OFF_COMPAT_RO_FLAGS, self.compat_ro_flags);
        put_u32(b, OFF_INCOMPAT_FLAGS, self.incompat_flags);
    }

    /// Field checks that do not need the rest of the metadata.
    pub fn validate(&self) -> Result<(), Corruption> {
        if self.magic != THIN_MAGIC {
            return Err(Corruption::BadSuperblock(format!(
                "bad magic {} (expected {THIN_MAGIC}): not dm-thin metadata",
                self.magic
            )));
        }
        if self.metadata_block_size_sectors != BLOCK_SECTORS {
            return Err(Corruption::BadSuperblock(format!(
                "metadata_block_size {} sectors (expected {BLOCK_SECTORS})",
                self.metadata_block_size_sectors
            )));
        }
        check_data_block_size(self.data_block_size_sectors).map_err(Corruption::BadSuperblock)?;
        if self.data_sm_root.nr_blocks > crate::meta::MAX_DATA_BLOCKS {
            return Err(Corruption::BadSuperblock(format!(
                "data space map of {} blocks (at most {} are possible)",
                self.data_sm_root.nr_blocks,
                crate::meta::MAX_DATA_BLOCKS
            )));
        }
        for (what, root) in [("data", &self.data_sm_root), ("metadata", &self.metadata_sm_root)] {
            if root.nr_allocated > root.nr_blocks {
                return Err(Corruption::BadSuperblock(format!(
                    "{what} space map has {} blocks allocated of {}",
                    root.nr_allocated, root.nr_blocks
                )));
            }
        }
        Ok(())
    }

    pub fn needs_check(&self) -> bool {
        self.flags & FLAG_NEEDS_CHECK != 0
    }
}

/// Valid dm-thin data block size in sectors.
pub fn check_data_block_size(sectors: u32) -> Result<(), String> {
    if !(MIN_DATA_BLOCK_SECTORS..=MAX_DATA_BLOCK_SECTORS).contains(&sectors)
        || !sectors.is_multiple_of(MIN_DATA_BLOCK_SECTORS)
    {
        return Err(format!(
            "data_block_size {sectors} sectors: must be a multiple of {MIN_DATA_BLOCK_SECTORS} in {MIN_DATA_BLOCK_SECTORS}..={MAX_DATA_BLOCK_SECTORS}"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::block::zeroed_block;

    #[test]
    fn pack_unpack_roundtrip_and_offsets() {
        let sb = Superblock {
            flags: 1,
            uuid: [0; 16],
            magic: THIN_MAGIC,
            version: 2,
            time: 7,
            trans_id: 99,
            held_root: 5,
            data_sm_root: SmRoot { nr_blocks: 2, nr_allocated: 1, bitmap_root: 3, ref_count_root: 4 },
            metadata_sm_root: SmRoot { nr_blocks: 6, nr_allocated: 5, bitmap_root: 7, ref_count_root: 8 },
            data_mapping_root: 10,
            device_details_root: 11,
            data_block_size_sectors: 128,
            metadata_block_size_sectors: 8,
            metadata_nr_blocks: 1024,
            compat_flags: 0,
            compat_ro_flags: 0,
            incompat_flags: 0,
        };
        let mut b = zeroed_block();
        sb.pack(&mut b);
        assert_eq!(Superblock::unpack(&b), sb);
        assert_eq!(get_u64(&b[..], 32), 27_022_010);
        assert_eq!(get_u64(&b[..], 64), 2);
        assert_eq!(get_u64(&b[..], 192), 6);
        assert_eq!(get_u64(&b[..], 320), 10);
        assert_eq!(get_u32(&b[..], 336), 128);
        assert!(b[364..].iter().all(|&x| x == 0));
        assert!(sb.validate().is_ok());
        assert!(Superblock { magic: 1, ..sb.clone() }.validate().is_err());
        assert!(Superblock { data_block_size_sectors: 100, ..sb.clone() }.validate().is_err());
        let over = SmRoot { nr_allocated: 3, ..sb.data_sm_root };
        assert!(Superblock { data_sm_root: over, ..sb.clone() }.validate().is_err(), "allocated > blocks");
        let huge = SmRoot { nr_blocks: crate::meta::MAX_DATA_BLOCKS + 1, ..sb.data_sm_root };
        assert!(Superblock { data_sm_root: huge, ..sb.clone() }.validate().is_err(), "beyond any data device");
    }
}
