#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tinybroker_fuzz::checks::check_request_input(data));
