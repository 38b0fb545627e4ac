//! The `tinybroker` binary: everything happens in [`tinybroker::cli`].

/// jemalloc: a published message is allocated on its publisher's thread and
/// freed on a subscriber's, which glibc's malloc serialises on the
/// publisher's arena lock. Measured in BENCHMARKS.md: 5-7 % less broker CPU
/// per message, consumer groups about 10 % faster, and the soak test's RSS
/// returns to its pre-run level.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    tinybroker::cli::main()
}
