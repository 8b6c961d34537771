//! `cargo run -p kvgate-protocol-codegen [-- --check]`: rewrite (or check)
//! `filter/protocol/src/gen/kvgate.v1.rs` from the .proto files.

use anyhow::{Context, Result};
use kvgate_protocol_codegen::{check, generate, generated_path, proto_root};

fn main() -> Result<()> {
    let root = proto_root();
    let target = generated_path();
    if std::env::args().any(|a| a == "--check") {
        check(&root, &target)?;
        println!("{} is up to date", target.display());
        return Ok(());
    }
    let code = generate(&root)?;
    std::fs::write(&target, code).with_context(|| format!("writing {}", target.display()))?;
    println!("wrote {}", target.display());
    Ok(())
}
