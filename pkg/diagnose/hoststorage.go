package diagnose

import (
	"context"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

// Kinds of findings about the host storage path under a hot-plugged volume
// (pkg/host.StorageReader reads it; each read needs its optional rule,
// docs/host-rbac.md).
const (
	// LonghornNotReady: the volume's Longhorn volume is faulted or has
	// replicas that cannot be scheduled; Longhorn refuses to attach it.
	LonghornNotReady = "longhorn-not-ready"
	// LonghornElsewhere: the Longhorn volume is attached on another host
	// node than the one its VM runs on.
	LonghornElsewhere = "longhorn-attached-elsewhere"
	// LonghornMigrating (informational): Longhorn is moving the volume
	// between host nodes, as for a VM's live migration.
	LonghornMigrating = "longhorn-migrating"
	// AttachmentVolumeWait: the VM's attachment pod is on its host node,
	// but the host has not attached or mounted its volume (FailedAttachVolume
	// or FailedMount Events).
	AttachmentVolumeWait = "attachment-pod-volume-wait"
	// AttachmentPodRefused: KubeVirt could not create the VM's attachment
	// pod (e.g. a ResourceQuota refuses it).
	AttachmentPodRefused = "attachment-pod-refused"
)

// findingKinds maps the host's issues to findings; an unschedulable
// attachment pod is attachment-pod-pending already.
var findingKinds = map[string]string{
	host.LonghornNotReady:        LonghornNotReady,
	host.LonghornElsewhere:       LonghornElsewhere,
	host.LonghornMigrating:       LonghornMigrating,
	host.AttachmentPodVolumeWait: AttachmentVolumeWait,
	host.AttachmentPodRefused:    AttachmentPodRefused,
}

// StorageIssues reads the host storage path under volumes.
type StorageIssues interface {
	Issues(ctx context.Context, q host.StorageQuery) ([]host.StorageIssue, error)
	Refused() []string
}

// gatherHostStorage reads the storage path under every hot-plugged volume a
// VM holds: the claim's Longhorn volume, and for a VM whose VMI does not
// have it Ready yet, the attachment pods. A read the identity may not make,
// or that fails, leaves its part out and says so in a note.
func gatherHostStorage(ctx context.Context, r StorageIssues, in *Input) {
	v := look(*in)
	in.HostStorage = map[string][]host.StorageIssue{}
	for _, vol := range sortedKeys(v.holds) {
		pvc := v.claims[vol]
		if pvc == nil || pvc.Status.Phase != corev1.ClaimBound {
			continue
		}
		q := host.StorageQuery{Claim: pvc}
		for _, vm := range sortedKeys(v.holds[vol]) {
			h := v.holds[vol][vm]
			if !h.held() {
				continue
			}
			q.Holders = append(q.Holders, vm)
			if h.status == nil || h.status.Phase != kubevirtv1.VolumeReady {
				q.Waiting = append(q.Waiting, vm)
			}
		}
		if len(q.Holders) == 0 {
			continue
		}
		issues, err := r.Issues(ctx, q)
		if err != nil {
			in.Notes = append(in.Notes, fmt.Sprintf("host storage path of %s partly unread: %v", vol, err))
		}
		in.HostStorage[vol] = issues
	}
	if refused := r.Refused(); len(refused) > 0 {
		in.Notes = append(in.Notes, "host storage reads not allowed ("+strings.Join(refused, "; ")+
			"): Longhorn volumes and attachment pod Events only partly checked (docs/host-rbac.md, --storage-read)")
	}
}

// judgeHostStorage turns the host storage issues of each volume into
// findings.
func (v *view) judgeHostStorage(r *report) {
	for _, vol := range sortedKeys(v.in.HostStorage) {
		for _, i := range v.in.HostStorage[vol] {
			kind, ok := findingKinds[i.Kind]
			if !ok {
				continue
			}
			r.add(Finding{Kind: kind, Volume: vol, VM: i.VM, Detail: i.Message, Info: kind == LonghornMigrating})
		}
	}
}
