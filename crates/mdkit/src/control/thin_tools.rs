//! Thin metadata tools on a running pool, through a metadata snapshot (dm-thin's
//! `reserve_metadata_snap` / `release_metadata_snap` messages, `thin_dump -m`, `thin_delta -m`).
//!
//! | command                      | args                                           | result          |
//! |------------------------------|------------------------------------------------|-----------------|
//! | `thin.reserve-metadata-snap` | pool                                           | held_root       |
//! | `thin.release-metadata-snap` | pool                                           | released        |
//! | `thin.dump`                  | pool, metadata_snap (read the held one; default: a transient one) | xml |
//! | `thin.delta`                 | pool, left, right, metadata_snap               | header, segments |
//!
//! `thin.delta` segments are `[kind, begin, length, left_data_begin|null, right_data_begin|null]`
//! with kind 0 same, 1 different, 2 left_only, 3 right_only (units: pool blocks); the CLI renders
//! them as thin_delta XML or JSON.

use std::sync::Arc;

use anyhow::Result;
use mdkit_thin::meta::delta::{self, DeltaHeader, DeltaKind, DeltaSegment};
use mdkit_thin::meta::snapshot_xml_metadata;
use mdkit_thin::pool::SnapUse;
use serde::Deserialize;
use serde_json::{Value, json};

use super::Registry;
use crate::service::Service;
use crate::volumes::thin::find_pool;

pub fn register(r: &mut Registry) {
    r.register("thin.reserve-metadata-snap", "hold a metadata snapshot of a pool (dm-thin message)", |svc, args| {
        Box::pin(async move { reserve(svc, args).await })
    });
    r.register("thin.release-metadata-snap", "release the pool's metadata snapshot", |svc, args| {
        Box::pin(async move { release(svc, args).await })
    });
    r.register("thin.dump", "thin_dump XML of a running pool, read through a metadata snapshot", |svc, args| {
        Box::pin(async move { dump(svc, args).await })
    });
    r.register("thin.delta", "blocks that differ between two thin devices (thin_delta)", |svc, args| {
        Box::pin(async move { delta_cmd(svc, args).await })
    });
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolArg {
    pool: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DumpArgs {
    pool: String,
    #[serde(default)]
    metadata_snap: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeltaArgs {
    pool: String,
    left: u64,
    right: u64,
    #[serde(default)]
    metadata_snap: bool,
}

fn snap_use(held: bool) -> SnapUse {
    if held { SnapUse::Held } else { SnapUse::Transient }
}

async fn reserve(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: PoolArg = super::parse_args("thin.reserve-metadata-snap", args)?;
    let pool = find_pool(&*svc.volumes.read().await, &a.pool)?;
    let held = pool.reserve_metadata_snap().await?;
    Ok(json!({ "pool": a.pool, "held_root": held }))
}

async fn release(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: PoolArg = super::parse_args("thin.release-metadata-snap", args)?;
    let pool = find_pool(&*svc.volumes.read().await, &a.pool)?;
    pool.release_metadata_snap().await?;
    Ok(json!({ "pool": a.pool, "released": true }))
}

async fn dump(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: DumpArgs = super::parse_args("thin.dump", args)?;
    let pool = find_pool(&*svc.volumes.read().await, &a.pool)?;
    let x = pool
        .read_metadata_snap(snap_use(a.metadata_snap), move |md| {
            let mut x = snapshot_xml_metadata(md)?;
            // As thin_dump: the attribute is never printed (restore drops the snapshot anyway).
            x.metadata_snap = None;
            Ok(x)
        })
        .await?;
    Ok(json!({ "pool": a.pool, "xml": x.to_xml_string() }))
}

async fn delta_cmd(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: DeltaArgs = super::parse_args("thin.delta", args)?;
    let pool = find_pool(&*svc.volumes.read().await, &a.pool)?;
    let (left, right) = (a.left, a.right);
    let (header, segments) = pool
        .read_metadata_snap(snap_use(a.metadata_snap), move |md| {
            let sb = md.metadata_snap_superblock()?;
            let header = DeltaHeader {
                time: sb.time,
                transaction: sb.trans_id,
                data_block_size: sb.data_block_size_sectors,
                nr_data_blocks: md.nr_data_blocks(),
            };
            let l = delta::snap_device_runs(md, left)?;
            let r = delta::snap_device_runs(md, right)?;
            Ok((header, delta::compare(&l, &r)))
        })
        .await?;
    Ok(json!({
        "pool": a.pool,
        "left": left,
        "right": right,
        "header": header_json(&header),
        "segments": segments.iter().map(segment_json).collect::<Vec<_>>(),
    }))
}

pub fn header_json(h: &DeltaHeader) -> Value {
    json!({ "time": h.time, "transaction": h.transaction, "data_block_size": h.data_block_size, "nr_data_blocks": h.nr_data_blocks })
}

pub fn header_from_json(v: &Value) -> DeltaHeader {
    let u = |k: &str| v[k].as_u64().unwrap_or(0);
    DeltaHeader {
        time: u("time") as u32,
        transaction: u("transaction"),
        data_block_size: u("data_block_size") as u32,
        nr_data_blocks: u("nr_data_blocks"),
    }
}

const KINDS: [DeltaKind; 4] = [DeltaKind::Same, DeltaKind::Different, DeltaKind::LeftOnly, DeltaKind::RightOnly];

fn segment_json(s: &DeltaSegment) -> Value {
    json!([s.kind as u8, s.begin, s.length, s.left_data, s.right_data])
}

/// The segments of a `thin.delta` answer; malformed entries are an error.
pub fn segments_from_json(v: &Value) -> Result<Vec<DeltaSegment>> {
    let bad = || anyhow::anyhow!("malformed thin.delta segment in the service's answer");
    let mut out = Vec::new();
    for s in v.as_array().ok_or_else(bad)? {
        let kind = s[0].as_u64().and_then(|k| KINDS.get(k as usize).copied()).ok_or_else(bad)?;
        out.push(DeltaSegment {
            kind,
            begin: s[1].as_u64().ok_or_else(bad)?,
            length: s[2].as_u64().ok_or_else(bad)?,
            left_data: s[3].as_u64(),
            right_data: s[4].as_u64(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_survive_the_wire_form() {
        let segs = vec![
            DeltaSegment { kind: DeltaKind::Different, begin: 3, length: 2, left_data: Some(7), right_data: Some(9) },
            DeltaSegment { kind: DeltaKind::RightOnly, begin: 9, length: 1, left_data: None, right_data: Some(1) },
        ];
        let v = Value::Array(segs.iter().map(segment_json).collect());
        assert_eq!(segments_from_json(&v).unwrap(), segs);
        assert!(segments_from_json(&json!([[7, 0, 1, null, null]])).is_err());
    }
}
