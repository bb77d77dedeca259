//! The whole request path, natively, through the mock host, for the three
//! shapes `make bench` measures: the filter's own work per request without
//! V8 or Envoy (`cargo bench -p sluice-core --bench path`). The mock's
//! own bookkeeping (strings copied into maps) is included, as a hostcall's
//! copy is in Envoy.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use criterion::{criterion_group, criterion_main, Criterion};
use sluice_core::bench::MockHost;

mod shapes;
use shapes::{chat_body, one_request, Shape, T0};

fn path(c: &mut Criterion) {
    let mut group = c.benchmark_group("path");
    let body = chat_body();
    for shape in Shape::ALL {
        let host = MockHost::new(T0);
        let poller = shape.load(&host);
        group.bench_function(shape.label(), |b| {
            b.iter(|| {
                one_request(&poller, &host, shape, &body);
                host.take_calls();
            })
        });
    }
    group.finish();
}

criterion_group!(benches, path);
criterion_main!(benches);
