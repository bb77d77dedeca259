//! `yaml2json FILE`: prints FILE (YAML) as one line of JSON on stdout.

use std::process::ExitCode;

fn main() -> ExitCode {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: yaml2json FILE.yaml");
        return ExitCode::from(2);
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("yaml2json: reading {path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    match serde_yaml::from_str::<serde_json::Value>(&text) {
        Ok(v) => {
            println!("{v}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("yaml2json: {path}: {e}");
            ExitCode::FAILURE
        }
    }
}
