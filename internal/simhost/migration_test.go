package simhost

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/simlonghorn"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// A live migration on the host nodes goes the way KubeVirt and Longhorn run
// it on Harvester: the target virt-launcher pod is placed by the scheduler
// off the source node and run by that node's kubelet; its attachment pod,
// owned by it and pinned to its node, gets the hot-plugged volume attached
// there by the attach/detach controller through Longhorn's migration while
// the source still holds it; after the hand-off the source's pods end and
// the host lets go of the source node, leaving the volume on the target
// only, still Ready in the VMI. On KubeVirt's real control plane its own
// migration controller drives it, the node agents playing the source and
// target virt-handler's handshake (internal/realkubevirt migration.go), and
// a legacy volume request during the transfer gets virt-api's refusal.
func TestLiveMigrationOnHostNodes(t *testing.T) {
	for _, tc := range []struct {
		name string
		real string
		sim  kubevirtsim.Options
	}{
		{name: "sim-v1.7.0-legacy", sim: kubevirtsim.Options{Version: kubevirtsim.V1_7_0, Mode: kubevirtsim.ModeLegacy, Scale: 0.05}},
		{name: "real-v1.7.0-legacy", real: "v1.7.0", sim: kubevirtsim.Options{Mode: kubevirtsim.ModeLegacy, Scale: 0.05}},
		{name: "real-v1.6.0-legacy", real: "v1.6.0", sim: kubevirtsim.Options{Mode: kubevirtsim.ModeLegacy, Scale: 0.05}},
	} {
		t.Run(tc.name, func(t *testing.T) { liveMigrationOnHostNodes(t, tc.real, tc.sim) })
	}
}

func liveMigrationOnHostNodes(t *testing.T, real string, so kubevirtsim.Options) {
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	h := startOnHostNodes(ctx, t, real, so, nil)
	kv := kubeVirtOf(t, h)
	vols, lhName := hotplugOneVolume(ctx, t, h, kv, "node-0")
	waitEntryReady(ctx, t, h, vols[0])
	source := h.HostNodeOf(ctx, "node-0")
	sourcePod := attachmentPod(ctx, t, h)
	if sourcePod == nil || sourcePod.Spec.NodeName != source {
		t.Fatalf("attachment pod before the migration: %+v, want one on %s", sourcePod, source)
	}
	late, err := h.CreateVolumes(ctx, "late", 1)
	if err != nil {
		t.Fatal(err)
	}

	// Held in its transfer, the migration shows both sides at once.
	h.HoldMigration("node-0", true)
	mig, err := h.Migrate(ctx, "node-0")
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(ctx, t, "the migration transferring", func() (bool, string) {
		m, ok := h.Migration(ctx, mig)
		if !ok {
			return false, "not in the cache"
		}
		return m.Status.Phase == kubevirtv1.MigrationRunning, string(m.Status.Phase) + ", pods " + podStates(ctx, h)
	})
	launcher := migrationPodOf(ctx, t, h, "virt-launcher")
	if launcher == nil || launcher.Spec.NodeName == "" || launcher.Spec.NodeName == source {
		t.Fatalf("target virt-launcher pod %+v, want one placed off the source node %s", launcher, source)
	}
	target := launcher.Spec.NodeName
	// The VMI names both virt-launcher pods with their nodes in
	// status.activePods, the only sign of the migration on the VMI before
	// its hand-off (v1.7.0 pkg/virt-controller/watch/vmi/lifecycle.go:909-928).
	testwait.Until(ctx, t, "the VMI naming both virt-launcher pods", func() (bool, string) {
		_, vmi := h.VM(ctx, "node-0")
		if vmi == nil {
			return false, "no VMI"
		}
		nodes := map[string]bool{}
		for _, n := range vmi.Status.ActivePods {
			nodes[n] = true
		}
		return len(vmi.Status.ActivePods) == 2 && vmi.Status.ActivePods[launcher.UID] == target && nodes[source],
			fmt.Sprintf("activePods %v", vmi.Status.ActivePods)
	})
	if !scheduledByScheduler(ctx, t, h, launcher) {
		t.Errorf("target virt-launcher pod %s was not placed by the scheduler", launcher.Name)
	}
	if !antiAffinityToVMI(launcher) {
		t.Errorf("target virt-launcher pod %s has affinity %+v, want KubeVirt's required anti-affinity to the VMI's pods by hostname", launcher.Name, launcher.Spec.Affinity)
	}
	tpod := migrationPodOf(ctx, t, h, "hotplug-disk")
	if tpod == nil || tpod.Spec.NodeName != target || !affinityTo(tpod, target) || !metav1.IsControlledBy(tpod, launcher) {
		t.Fatalf("target attachment pod %+v, want one on %s required there and owned by %s", tpod, target, launcher.Name)
	}
	if !scheduledByScheduler(ctx, t, h, tpod) {
		t.Errorf("target attachment pod %s was not placed by the scheduler", tpod.Name)
	}
	for _, node := range []string{source, target} {
		if va, err := hostVolumeAttachmentOn(ctx, h, lhName, node); err != nil || va == nil || !va.Status.Attached {
			t.Errorf("during the migration, host VolumeAttachment of %s on %s: %+v (%v), want attached", lhName, node, va, err)
		}
	}
	lv, err := h.Longhorn.Volume(ctx, lhName)
	if err != nil {
		t.Fatal(err)
	}
	if lv.Status.CurrentNodeID != source || lv.Status.CurrentMigrationNodeID != target {
		t.Errorf("during the migration, Longhorn volume %s: %+v, want its engine on %s migrating to %s", lhName, lv.Status, source, target)
	}
	if p, err := h.Kube.CoreV1().Pods(h.Namespace).Get(ctx, sourcePod.Name, metav1.GetOptions{}); err != nil || p.DeletionTimestamp != nil {
		t.Errorf("source attachment pod %s gone during the migration: %v", sourcePod.Name, err)
	}

	// KubeVirt's own refusal of a legacy volume request while the VMI
	// migrates (v1.7.0 pkg/virt-api/webhooks/validating-webhook/admitters/
	// vms-admitter.go:449-455).
	err = kv.KubevirtV1().VirtualMachines(h.Namespace).AddVolume(ctx, "node-0", &kubevirtv1.AddVolumeOptions{
		Name: late[0], Disk: &kubevirtv1.Disk{DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusSCSI}}},
		VolumeSource: &kubevirtv1.HotplugVolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
			PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: late[0]}, Hotpluggable: true}},
	})
	if err == nil || !strings.Contains(err.Error(), "Cannot handle volume requests while VMI migration is in progress") {
		t.Errorf("legacy hot-plug during the transfer: %v, want KubeVirt's refusal", err)
	}

	h.HoldMigration("node-0", false)
	testwait.Until(ctx, t, "the migration Succeeded", func() (bool, string) {
		m, ok := h.Migration(ctx, mig)
		if !ok {
			return false, "not in the cache"
		}
		return m.Status.Phase == kubevirtv1.MigrationSucceeded, string(m.Status.Phase)
	})
	if _, vmi := h.VM(ctx, "node-0"); vmi == nil || vmi.Status.NodeName != target || vmi.Status.MigrationState == nil ||
		!vmi.Status.MigrationState.Completed || vmi.Status.MigrationState.Failed {
		t.Errorf("after the migration the VMI is %+v, want it on %s with its migration completed", vmi, target)
	} else if h.Real != nil && vmi.Labels[kubevirtv1.NodeNameLabel] != target {
		t.Errorf("after the migration the VMI's labels are %v, want %s=%s", vmi.Labels, kubevirtv1.NodeNameLabel, target)
	}
	testwait.Until(ctx, t, "the source released", func() (bool, string) {
		pods, err := h.Kube.CoreV1().Pods(h.Namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		for _, p := range pods.Items {
			// A virt-launcher pod ends with its exited container, as
			// KubeVirt leaves it; the simulator deletes it.
			if p.Spec.NodeName == source && (p.Status.Phase != corev1.PodSucceeded || p.Labels[kubevirtv1.AppLabel] != "virt-launcher") {
				return false, "pod " + p.Name + " still on " + source + " (" + string(p.Status.Phase) + ")"
			}
		}
		if va, err := hostVolumeAttachmentOn(ctx, h, lhName, source); err != nil || va != nil {
			return false, fmt.Sprintf("host VolumeAttachment on %s: %+v %v", source, va, err)
		}
		lv, err := h.Longhorn.Volume(ctx, lhName)
		if err != nil {
			return false, err.Error()
		}
		return lv.Status.CurrentNodeID == target && lv.Status.CurrentMigrationNodeID == "" && lv.Spec.MigrationNodeID == "",
			fmt.Sprintf("Longhorn spec %+v status %+v", lv.Spec, lv.Status)
	})
	if va, err := hostVolumeAttachmentOn(ctx, h, lhName, target); err != nil || va == nil || !va.Status.Attached {
		t.Errorf("after the migration, host VolumeAttachment of %s on %s: %+v (%v), want attached", lhName, target, va, err)
	}
	waitEntryReady(ctx, t, h, vols[0])
}

func waitEntryReady(ctx context.Context, t *testing.T, h *Host, volume string) {
	t.Helper()
	testwait.Until(ctx, t, "the VMI entry of "+volume+" Ready", func() (bool, string) {
		_, vmi := h.VM(ctx, "node-0")
		if vmi == nil {
			return false, "no VMI"
		}
		for _, e := range vmi.Status.VolumeStatus {
			if e.Name == volume {
				return e.Phase == kubevirtv1.VolumeReady, fmt.Sprintf("%+v", e)
			}
		}
		return false, "no entry"
	})
}

// podStates sums up the host pods for a failure message.
func podStates(ctx context.Context, h *Host) string {
	// The last message is taken as the wait ends: read past its context.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	pods, err := h.Kube.CoreV1().Pods(h.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	var out []string
	for _, p := range pods.Items {
		out = append(out, fmt.Sprintf("%s@%s:%s", p.Name, p.Spec.NodeName, p.Status.Phase))
	}
	return strings.Join(out, " ")
}

// migrationPodOf is the live pod of kind (the kubevirt.io label) that a
// migration created.
func migrationPodOf(ctx context.Context, t *testing.T, h *Host, kind string) *corev1.Pod {
	t.Helper()
	pods, err := h.Kube.CoreV1().Pods(h.Namespace).List(ctx, metav1.ListOptions{LabelSelector: kubevirtv1.AppLabel + "=" + kind + "," + kubevirtv1.MigrationJobLabel})
	if err != nil {
		t.Fatal(err)
	}
	for i := range pods.Items {
		if pods.Items[i].DeletionTimestamp == nil {
			return &pods.Items[i]
		}
	}
	return nil
}

func hostVolumeAttachmentOn(ctx context.Context, h *Host, pv, node string) (*storagev1.VolumeAttachment, error) {
	l, err := h.Kube.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	for i := range l.Items {
		va := &l.Items[i]
		if va.Spec.Attacher == simlonghorn.DriverName && va.Spec.NodeName == node &&
			va.Spec.Source.PersistentVolumeName != nil && *va.Spec.Source.PersistentVolumeName == pv {
			return va, nil
		}
	}
	return nil, nil
}

// antiAffinityToVMI reports whether pod must not share a hostname with the
// pods KubeVirt created for its VMI (kubevirt v1.7.0
// pkg/virt-controller/watch/migration/migration.go:858-880).
func antiAffinityToVMI(pod *corev1.Pod) bool {
	a := pod.Spec.Affinity
	if a == nil || a.PodAntiAffinity == nil {
		return false
	}
	for _, term := range a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution {
		if term.TopologyKey == corev1.LabelHostname && term.LabelSelector != nil && term.LabelSelector.MatchLabels[kubevirtv1.CreatedByLabel] != "" {
			return true
		}
	}
	return false
}
