package mounter

import (
	"fmt"
	"net"
	"path"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
)

// DefaultNFSVersion is the protocol version used when neither the
// StorageClass's mount options nor the export's recommended options name one
// (upstream mounts Harvester's exports with vers=4).
const DefaultNFSVersion = "vers=4"

// IsNFS reports whether a mount table's filesystem type is an NFS mount.
func IsNFS(fsType string) bool { return fsType == "nfs" || fsType == "nfs4" }

// NFSSource builds mount(8)'s "server:/export" from an endpoint (an IP
// address or a DNS name) and an absolute export path. Both come from the
// host; anything that could be read as another option, another server or a
// relative path is refused.
func NFSSource(endpoint, export string) (string, error) {
	if endpoint == "" || export == "" {
		return "", fmt.Errorf("NFS endpoint %q and export %q are both required", endpoint, export)
	}
	server := endpoint
	if ip := net.ParseIP(endpoint); ip != nil {
		if ip.To4() == nil {
			server = "[" + ip.String() + "]"
		}
	} else if errs := validation.IsDNS1123Subdomain(endpoint); len(errs) > 0 {
		return "", fmt.Errorf("NFS endpoint %q is neither an IP address nor a DNS name: %s", endpoint, strings.Join(errs, "; "))
	}
	if !strings.HasPrefix(export, "/") || path.Clean(export) != export || strings.ContainsAny(export, ",: \t\n") {
		return "", fmt.Errorf("NFS export %q is not an absolute path in clean form", export)
	}
	return server + ":" + export, nil
}

// NFSOptions are the options of an NFS mount: the export's recommended
// options, then the StorageClass's mount options (the volume capability's
// mount flags: later wins in mount(8)), with DefaultNFSVersion in front when
// neither names a protocol version.
func NFSOptions(flags []string, recommended string) []string {
	var out []string
	for _, o := range strings.Split(recommended, ",") {
		if o = strings.TrimSpace(o); o != "" {
			out = append(out, o)
		}
	}
	for _, f := range flags {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	for _, o := range out {
		k, _, _ := strings.Cut(o, "=")
		if k == "vers" || k == "nfsvers" || k == "v3" || k == "v4" {
			return out
		}
	}
	return append([]string{DefaultNFSVersion}, out...)
}

// SameNFSSource compares two "server:/export" strings as mount tables show
// them (a trailing slash on the export does not matter).
func SameNFSSource(a, b string) bool {
	trim := func(s string) string {
		if len(s) > 1 {
			return strings.TrimSuffix(s, "/")
		}
		return s
	}
	return trim(a) == trim(b)
}
