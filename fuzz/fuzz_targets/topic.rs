#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tinybroker_fuzz::checks::check_topic_input(data));
