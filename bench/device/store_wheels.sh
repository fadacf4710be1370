#!/usr/bin/env bash
# bash bench/device/store_wheels.sh OUT [PYVER]: run here (it downloads from the package registry), then carry OUT
# with serve_remote.sh as its STORE_WHEELS (e.g. demo/whl-store, 14 MB). The wheels that bench/serve/store.py and the
# app's s3:// roots need beyond the GPU image (Python PYVER, default 3.12):
# s3fs and its fsspec, aiobotocore, botocore and boto3 (their service data cut to the S3 server's), obstore (the
# app's ranged reads), moto's S3 server (its other services cut) with flask, and cryptography (moto imports it on
# every request).
set -euo pipefail
out=$1; py=${2:-3.12}
mkdir -p "$out"
dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any -d "$out" "$@" 2>&1 \
    | grep -v 'is ignored' || true
}
dl s3fs==2026.9.0 fsspec==2026.9.0 aiobotocore==3.10.0 aioitertools==0.13.0 wrapt==2.5.2 jmespath==1.1.0 \
   python-dateutil==2.9.0.post0 six==1.17.0 botocore==1.43.117 boto3==1.43.117 s3transfer==0.19.3 \
   moto==5.2.5 flask==3.1.3 flask-cors==6.0.5 werkzeug==3.1.9 itsdangerous==2.2.0 blinker==1.9.0 click==8.5.1 \
   xmltodict==1.0.4 responses==0.26.3 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 obstore==0.12.1
# botocore's data for 430 services is 15 of its 17 MB, moto's other services 6 of its 7: keep what S3 needs.
cut() {  # cut WHEEL KEEP_REGEX: drop the files of the wheel's top-level package under PREFIX that KEEP_REGEX misses
  local whl=$1 prefix=$2 keep=$3 tmp; tmp=$(mktemp -d)
  [ -f "$whl.cut" ] && return 0
  (cd "$tmp" && unzip -q "$whl")
  find "$tmp/$prefix" -mindepth 1 -maxdepth 1 -type d | grep -vE "/$prefix/($keep)\$" | xargs rm -rf
  local record; record=$(ls -d "$tmp"/*.dist-info)/RECORD
  (cd "$tmp" && find . -type f ! -path "*/RECORD" | sed 's|^\./||' | sed 's/$/,,/' > "$record.new"; echo "${record#$tmp/},," >> "$record.new"; mv "$record.new" "$record")
  rm -f "$whl"; (cd "$tmp" && zip -q -r -9 "$whl" .); rm -rf "$tmp"; touch "$whl.cut"
}
out=$(cd "$out" && pwd)
cut "$out"/botocore-1.43.117-py3-none-any.whl botocore/data "s3|sts|sso|sso-oidc"
cut "$out"/moto-5.2.5-py3-none-any.whl moto "core|s3|s3bucket_path|moto_api|moto_server|utilities|iam|sts|cloudwatch|events"
rm -f "$out"/*.cut
du -sh "$out"
