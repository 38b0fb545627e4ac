//! The `tinybroker` binary: everything happens in [`tinybroker::cli`].

fn main() -> std::process::ExitCode {
    tinybroker::cli::main()
}
