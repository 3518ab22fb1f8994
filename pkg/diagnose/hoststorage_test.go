package diagnose

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/host"
)

type fakeStorage struct {
	issues  map[string][]host.StorageIssue
	err     error
	refused []string
	queries []host.StorageQuery
}

func (f *fakeStorage) Issues(_ context.Context, q host.StorageQuery) ([]host.StorageIssue, error) {
	f.queries = append(f.queries, q)
	return f.issues[q.Claim.Name], f.err
}

func (f *fakeStorage) Refused() []string { return f.refused }

func boundHostClaim(name string) corev1.PersistentVolumeClaim {
	c := hostClaim(name, "pv-"+name)
	c.Status.Phase = corev1.ClaimBound
	return c
}

// TestHostStorageFindings: each issue of the host storage path is a finding
// of its volume and VM; a migration is informational, and an unschedulable
// attachment pod is left to attachment-pod-pending.
func TestHostStorageFindings(t *testing.T) {
	in := Input{Driver: drv, Namespace: "ns", HostStorage: map[string][]host.StorageIssue{
		"pvc-faulted": {{Kind: host.LonghornNotReady, Message: "Longhorn volume pv-faulted is not ready for workloads: faulted"}},
		"pvc-moved":   {{Kind: host.LonghornElsewhere, VM: "vm-b", Message: "still attached on host node host-a"}},
		"pvc-moving":  {{Kind: host.LonghornMigrating, Message: "migrating from host node host-a to host-b"}},
		"pvc-quota":   {{Kind: host.AttachmentPodRefused, VM: "vm-a", Message: "KubeVirt cannot create the attachment pod of VM vm-a: exceeded quota"}},
		"pvc-mount":   {{Kind: host.AttachmentPodVolumeWait, VM: "vm-a", Message: "FailedAttachVolume"}},
		"pvc-cordon":  {{Kind: host.AttachmentPodUnschedulable, VM: "vm-a", Message: "not scheduled"}},
	}}
	findings := Check(in)
	want := []string{
		LonghornNotReady + "/pvc-faulted/",
		AttachmentVolumeWait + "/pvc-mount/vm-a",
		LonghornElsewhere + "/pvc-moved/vm-b",
		LonghornMigrating + "/pvc-moving/",
		AttachmentPodRefused + "/pvc-quota/vm-a",
	}
	if got := kinds(findings); !slices.Equal(got, want) {
		t.Fatalf("findings\n%v\nwant\n%v", got, want)
	}
	for _, f := range findings {
		if f.Info != (f.Kind == LonghornMigrating) {
			t.Errorf("%s: informational %v", f, f.Info)
		}
		if f.Kind == AttachmentPodRefused && !strings.Contains(f.Detail, "exceeded quota") {
			t.Errorf("the refusal's finding does not give KubeVirt's message: %s", f)
		}
	}
}

// TestGatherHostStorage: the storage path is read for each bound claim a VM
// holds, with the holders whose VMI does not have it Ready as the ones
// waiting; refused reads and failures are notes, never a failed look.
func TestGatherHostStorage(t *testing.T) {
	pending := boundHostClaim("pvc-pending")
	pending.Status.Phase = corev1.ClaimPending
	in := Input{Driver: drv, Namespace: "ns",
		VMs: []kubevirtv1.VirtualMachine{vm("vm-a", []string{"pvc-ready", "pvc-new", "pvc-pending"}), vm("vm-b", []string{"pvc-new"})},
		VMIs: []kubevirtv1.VirtualMachineInstance{vmi("vm-a", map[string]kubevirtv1.VolumePhase{"pvc-ready": kubevirtv1.VolumeReady}),
			vmi("vm-b", map[string]kubevirtv1.VolumePhase{"pvc-new": kubevirtv1.HotplugVolumeAttachedToNode})},
		HostClaims: []corev1.PersistentVolumeClaim{boundHostClaim("pvc-ready"), boundHostClaim("pvc-new"), pending, boundHostClaim("pvc-unheld")},
	}
	r := &fakeStorage{issues: map[string][]host.StorageIssue{"pvc-new": {{Kind: host.LonghornElsewhere, VM: "vm-b"}}},
		err: errors.New("read Longhorn volume pv-pvc-ready: timeout"), refused: []string{"list events"}}
	gatherHostStorage(context.Background(), r, &in)
	var got []string
	for _, q := range r.queries {
		got = append(got, q.Claim.Name+" holders="+strings.Join(q.Holders, ",")+" waiting="+strings.Join(q.Waiting, ","))
	}
	want := []string{"pvc-new holders=vm-a,vm-b waiting=vm-a,vm-b", "pvc-ready holders=vm-a waiting="}
	if !slices.Equal(got, want) {
		t.Errorf("queries\n%v\nwant\n%v", got, want)
	}
	if len(in.HostStorage["pvc-new"]) != 1 {
		t.Errorf("issues kept: %v", in.HostStorage)
	}
	notes := strings.Join(in.Notes, "\n")
	for _, w := range []string{"list events", "partly unread: read Longhorn volume pv-pvc-ready: timeout"} {
		if !strings.Contains(notes, w) {
			t.Errorf("notes %q lack %q", notes, w)
		}
	}
}
