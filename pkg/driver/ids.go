package driver

import (
	"crypto/sha256"
	"fmt"
	"regexp"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/util/validation"
)

const (
	minVolumeBytes   = 10 << 20 // Longhorn's smallest volume
	volumeBytesAlign = 2 << 20  // Longhorn sizes volumes in 2 MiB steps
	// maxVolumeBytes is the largest volume this driver asks the host for
	// (1 PiB): far beyond any Harvester disk, and small enough that no size
	// arithmetic can overflow. Larger requests are OutOfRange.
	maxVolumeBytes = 1 << 50
)

// hostPVCName is the host PVC (and volume ID) for a CreateVolume name. The
// external-provisioner's names (pvc-<uid>) are used as they are, as upstream
// does. Any other name is mapped to a valid, stable and collision-free one:
// the volume ID also names the VM's hotplug volume and disk, so it must be a
// DNS-1123 label.
func hostPVCName(name string) string {
	if len(validation.IsDNS1123Label(name)) == 0 {
		return name
	}
	sum := sha256.Sum256([]byte(name))
	clean := strings.Trim(notLabelChars.ReplaceAllString(strings.ToLower(name), "-"), "-")
	if len(clean) > 40 {
		clean = strings.TrimRight(clean[:40], "-")
	}
	if clean == "" {
		return fmt.Sprintf("vol-%x", sum[:8])
	}
	return fmt.Sprintf("vol-%s-%x", clean, sum[:8])
}

var notLabelChars = regexp.MustCompile(`[^a-z0-9]+`)

// validObjectName reports whether id can name a host object at all. An ID
// that cannot is not a volume (or snapshot) of this driver: the answer is
// NotFound (or OK for a delete), never an internal error that makes the
// sidecars retry forever.
func validObjectName(id string) bool {
	return len(validation.IsDNS1123Subdomain(id)) == 0
}

// volumeSize applies Longhorn's minimum and 2 MiB granularity to a range.
func volumeSize(r *csi.CapacityRange) (int64, error) {
	req, limit := r.GetRequiredBytes(), r.GetLimitBytes()
	switch {
	case req < 0 || limit < 0:
		return 0, status.Errorf(codes.InvalidArgument, "capacity range must not be negative (required %d, limit %d bytes)", req, limit)
	case req > maxVolumeBytes:
		return 0, status.Errorf(codes.OutOfRange, "volume of %d bytes exceeds the largest volume this driver creates (%d bytes, 1 PiB)", req, int64(maxVolumeBytes))
	}
	want := max(req, minVolumeBytes)
	size := (want + volumeBytesAlign - 1) / volumeBytesAlign * volumeBytesAlign
	if limit > 0 && size > limit {
		return 0, status.Errorf(codes.OutOfRange, "volume of at least %d bytes (rounded to %d) exceeds the limit of %d bytes", req, size, limit)
	}
	return size, nil
}
