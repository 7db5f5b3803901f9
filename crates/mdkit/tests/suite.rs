//! The crate's integration tests as one binary: each tests/*.rs file is a module here, so the
//! suite compiles and links one test binary per crate instead of one per file (each file used
//! to be its own crate that optimised its own copies of the shared generics, then linked).
//! A new test file needs a `mod` line below; shared helpers are reached with `use crate::...`.

mod common;
mod docs_harness;

mod bad_input;
mod bench_smoke;
mod block_status;
mod cli;
mod cli_paths;
mod clients;
mod control_clients;
mod control_hostile;
mod docs;
mod examine_remote;
mod ext4;
mod file_volume_in_use;
mod hostile_values;
mod isolation;
mod md;
mod md_assemble_refusals;
mod md_cli_paths;
mod md_parity;
mod metrics;
mod monitor;
mod name_race;
mod remote;
mod remote_link;
mod same_device;
mod signals;
mod soak;
mod systemd;
mod thin;
mod thin_activate_lab;
mod thin_cli_paths;
mod thin_corrupt;
mod thin_lifecycle;
mod thin_origin;
mod thin_pool_cycle;
mod thin_repair_lab;
mod thin_service_refusals;
mod thin_tools;
