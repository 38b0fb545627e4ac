//! The checks the fuzz targets run; `tests/fuzz_corpus.rs` includes the
//! same file so that the corpus and proptest replay them under `cargo test`.

pub mod checks;
