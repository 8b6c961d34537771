//! The `kvgate` binary, built here too so that the end-to-end tests of this
//! package can start it (`CARGO_BIN_EXE_kvgate`): the same `kvgate::run` as
//! `control-plane/kvgate`'s binary.

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    kvgate::run()
}
