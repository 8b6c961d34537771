//! The `kvgate` binary: mimalloc and the command line (`kvgate::run`).

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    kvgate::run()
}
