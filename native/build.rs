//! Links the module with `-z now`: every Envoy callback it declares is
//! bound when Envoy loads it, so a callback this Envoy does not export (a
//! renamed or removed ABI function) fails the load with the symbol's name
//! instead of a crash at its first call.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,now");
}
