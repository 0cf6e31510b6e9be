//! The integration tests, one binary: each former `tests/<name>.rs` is the module
//! `<name>` here (`cargo test --test it <name>::` runs one of them), and the harness in
//! `common/` is compiled and linked once for all of them. Fixtures stay in `tests/fixtures/`.

mod common;
// `crate::seed`, as in the library's unit tests (`proptest_seeds!` names it so).
use common::seed;

mod algorithms_agree;
mod batching;
mod calendar;
mod combined_keys;
mod config_fixtures;
mod dashboards;
mod docs;
mod e2e;
mod egress; // issue 45: the egress gateway
mod failover;
mod faults;
mod features;
mod forward_auth;
mod grpc;
mod grpc_answers;
mod h2_pools;
mod h2_refusals;
mod jwt;
mod jwt_quick_start;
mod key_directory;
mod key_flood;
mod labels;
mod layering;
mod local_share;
mod logs;
mod message_meter;
mod newcomer;
mod observability;
mod overload;
mod perimeter;
mod pools;
mod refused_counted;
mod request_path;
mod rls; // issue 44: Envoy's rate limit service
mod route_prefix;
mod scale;
mod sentinel;
mod service;
mod settle_agree;
mod settle_attacks;
mod settlement;
mod setup;
mod stores_agree;
mod tags;
mod tls;
mod two_readings;
mod upstream;
mod upstream_tls;
mod websocket;
