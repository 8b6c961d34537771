//! `cargo run -p kvgate-protocol-codegen [-- --check]`: rewrite (or check)
//! the checked-in prost and tonic code from the .proto files.

use anyhow::{Context, Result};
use kvgate_protocol_codegen::{check_all, generate_all, proto_root};

fn main() -> Result<()> {
    let root = proto_root();
    if std::env::args().any(|a| a == "--check") {
        check_all(&root)?;
        println!("generated code is up to date");
        return Ok(());
    }
    for (path, code) in generate_all(&root)? {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::write(&path, code).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
