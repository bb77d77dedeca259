//! The HTTP API the Envoy filter and the operators call: the routes and
//! their handlers ([`api`]), the admin token ([`admin`]), `/metrics`
//! ([`metrics`]) and the operator page ([`page`]). Imports every layer
//! below it; nothing below imports it.

pub mod admin;
pub mod api;
pub mod metrics;
pub mod page;
