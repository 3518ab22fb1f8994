package kubevirtsim

import (
	"encoding/json"
	"fmt"
	"slices"
	"sort"

	corev1 "k8s.io/api/core/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/virthandler"
)

// The volumeStatus machine of a hotplug volume, as two writers see it.
//
// virt-controller (controllerVolumeStatus) owns the attach side: it points
// an entry at the attachment pod that holds the VMI's whole hotplug set and
// moves it from the PVC phase (Pending/Bound) to AttachedToNode, or back to
// the PVC phase when no such pod exists; and the detach side: an entry whose
// volume left the spec stays while some attachment pod still holds the
// volume and goes once none does.
//
// virt-handler (internal/virthandler Phase) owns what happens on the node: MountedToPod
// once the volume is mounted into virt-launcher, Ready once the domain has
// the disk (a target), UnMountedFromPod once a removed volume is unmounted.
//
// Neither side ever moves an entry out of a phase it does not expect: that
// is where KubeVirt gets stuck (see the package doc).

// Attachment pod labels and annotations.
const (
	labelAttachmentPod = "kubevirt.io"
	valueAttachmentPod = "hotplug-disk"
	// labelAttachmentPodVMI names the VMI an attachment pod belongs to.
	labelAttachmentPodVMI = "kubevirtsim.io/vmi"
	// annotationAttachmentPodVolumes lists (JSON) the VMI volume names an
	// attachment pod holds; KubeVirt names the pod's volumes after them.
	annotationAttachmentPodVolumes = "kubevirtsim.io/volumes"
)

// volumeStatus reasons (v1.7.0 pkg/controller/controller.go and
// pkg/virt-handler/controller.go).
const (
	reasonPVCNotReady      = "PVCNotReady"
	reasonPVCNotFound      = "FailedPvcNotFound"
	reasonSuccessfulCreate = "SuccessfulCreate"
	reasonSuccessfulDelete = "SuccessfulDelete"
	reasonMounted          = "VolumeMountedToPod"
	reasonUnMounted        = "VolumeUnMountedFromPod"
	reasonVolumeReady      = "VolumeReady"
)

// canMoveToAttachedPhase: only an entry in "", Pending or Bound goes to
// AttachedToNode when a current pod exists (v1.7.0
// pkg/virt-controller/watch/vmi/volume-hotplug.go:228, v1.5.3 vmi.go:2158,
// the same in every tag). A re-added volume whose entry is still
// UnMountedFromPod or Detaching stays there.
func canMoveToAttachedPhase(p kubevirtv1.VolumePhase) bool {
	return p == "" || p == kubevirtv1.VolumeBound || p == kubevirtv1.VolumePending
}

// unpluggedPhase is the phase virt-controller writes for an entry whose
// volume left the spec while a pod still holds it: v1.6 and later keep
// Ready and MountedToPod until virt-handler unmounts the volume (v1.7.0
// storage.go:268 phaseForUnpluggedVolume); v1.5.3 writes Detaching at once
// (vmi.go:2114).
func (f features) unpluggedPhase(p kubevirtv1.VolumePhase) kubevirtv1.VolumePhase {
	if f.keepMountedOnUnplug && (p == kubevirtv1.VolumeReady || p == kubevirtv1.HotplugVolumeMounted) {
		return p
	}
	return kubevirtv1.HotplugVolumeDetaching
}

// pvcPhase is an entry's phase while no attachment pod serves it (v1.7.0
// storage.go:284 getVolumePhaseMessageReason). A claim in phase Lost reads
// "PVC is in phase Lost".
func (f features) pvcPhase(claim string, pvc *corev1.PersistentVolumeClaim) (kubevirtv1.VolumePhase, string, string) {
	switch {
	case pvc == nil:
		return kubevirtv1.VolumePending, reasonPVCNotFound, f.pvcNotFoundMessage(claim)
	case pvc.Status.Phase == corev1.ClaimPending:
		return kubevirtv1.VolumePending, reasonPVCNotReady, "PVC is in phase ClaimPending"
	case pvc.Status.Phase == corev1.ClaimBound:
		return kubevirtv1.VolumeBound, reasonPVCNotReady, "PVC is in phase Bound"
	default:
		return kubevirtv1.VolumePending, reasonPVCNotReady, "PVC is in phase Lost"
	}
}

// hotVolume is a hotplug volume of a VMI spec with its claim.
type hotVolume struct {
	name, claim string
	pvc         *corev1.PersistentVolumeClaim // nil: missing
}

// controllerInput is what virt-controller's status update looks at.
type controllerInput struct {
	feat features
	vmi  *kubevirtv1.VirtualMachineInstance
	hot  []hotVolume
	// pods are the VMI's attachment pods as the controller sees them,
	// newest first: the cache, plus a pod this pass created (the informer
	// delivered it before the status update ran: the losing side of the race
	// PR 17139 describes, and the one that sticks).
	pods []*corev1.Pod
}

// controllerVolumeStatus is virt-controller's updateVolumeStatus (v1.7.0
// pkg/virt-controller/watch/vmi/storage.go:138; v1.8.2 storage.go:257;
// v1.5.3 vmi/vmi.go:2005).
func controllerVolumeStatus(in controllerInput) []kubevirtv1.VolumeStatus {
	old := map[string]kubevirtv1.VolumeStatus{}
	for _, e := range in.vmi.Status.VolumeStatus {
		old[e.Name] = e
	}
	// The pod that holds every hotplug volume of the spec, ready or not: when
	// none does, every entry not yet Ready falls back to its PVC phase.
	current, _ := activeAndOldPods(in.feat, hotNames(in.hot), in.pods)
	hot := map[string]hotVolume{}
	for _, h := range in.hot {
		hot[h.name] = h
	}

	var out []kubevirtv1.VolumeStatus
	for _, v := range in.vmi.Spec.Volumes {
		e, ok := old[v.Name]
		if !ok {
			e = kubevirtv1.VolumeStatus{Name: v.Name}
		}
		delete(old, v.Name)
		e = *e.DeepCopy()
		if h, isHot := hot[v.Name]; isHot {
			attachStep(in.feat, &e, h, current)
			if h.pvc != nil {
				e.PersistentVolumeClaimInfo = pvcInfo(h.pvc)
			}
		}
		out = append(out, e)
	}
	for _, e := range old { // volumes no longer in the spec
		if e.HotplugVolume == nil {
			continue
		}
		pod := podHolding(e.Name, in.pods)
		if pod == nil {
			continue // storage.go:256: the entry goes with the last pod holding it
		}
		e = *e.DeepCopy()
		detachStep(in.feat, &e, pod)
		out = append(out, e)
	}
	sortEntries(out)
	return out
}

// attachStep advances the entry of a hotplug volume in the spec (v1.7.0
// storage.go:177-212; v1.8.2 storage.go:163 processHotplugVolumeStatus).
func attachStep(f features, e *kubevirtv1.VolumeStatus, h hotVolume, current *corev1.Pod) {
	if e.HotplugVolume == nil {
		e.HotplugVolume = &kubevirtv1.HotplugVolumeStatus{}
	}
	if current == nil {
		if e.Phase != kubevirtv1.VolumeReady {
			e.HotplugVolume.AttachPodUID = ""
			e.Phase, e.Reason, e.Message = f.pvcPhase(h.claim, h.pvc)
		}
		return
	}
	e.HotplugVolume.AttachPodName = current.Name
	e.HotplugVolume.AttachPodUID = ""
	if containerReady(current) { // a terminating pod's container may still be ready
		e.HotplugVolume.AttachPodUID = current.UID
	}
	if canMoveToAttachedPhase(e.Phase) {
		e.Phase, e.Reason = kubevirtv1.HotplugVolumeAttachedToNode, reasonSuccessfulCreate
		e.Message = fmt.Sprintf("Created hotplug attachment pod %s, for volume %s", current.Name, e.Name)
	}
	if f.resetDetachingOnReadd && e.Phase == kubevirtv1.HotplugVolumeDetaching {
		e.Phase, e.Reason, e.Message = f.pvcPhase(h.claim, h.pvc)
	}
}

// detachStep advances the entry of a volume that left the spec while pod
// still holds it (v1.7.0 storage.go:242-259, v1.5.3 vmi.go:2107-2122).
func detachStep(f features, e *kubevirtv1.VolumeStatus, pod *corev1.Pod) {
	e.HotplugVolume.AttachPodName = pod.Name
	e.HotplugVolume.AttachPodUID = pod.UID
	e.Phase = f.unpluggedPhase(e.Phase)
	if e.Phase == kubevirtv1.HotplugVolumeDetaching && pod.DeletionTimestamp != nil {
		e.Reason = reasonSuccessfulDelete
		e.Message = fmt.Sprintf("Deleted hotplug attachment pod %s, for volume %s", pod.Name, e.Name)
	}
}

// hotplugVolumesReady is virt-handler's gate before it starts the domain
// (v1.7.0 pkg/virt-handler/vm.go:2232): every hotplug entry MountedToPod or
// Ready.
func hotplugVolumesReady(vmi *kubevirtv1.VirtualMachineInstance, entries []kubevirtv1.VolumeStatus) bool {
	if !slices.ContainsFunc(vmi.Spec.Volumes, isHotpluggable) {
		return true
	}
	if len(entries) == 0 {
		return false
	}
	for _, e := range entries {
		if e.HotplugVolume != nil && e.Phase != kubevirtv1.VolumeReady && e.Phase != kubevirtv1.HotplugVolumeMounted {
			return false
		}
	}
	return true
}

// activeAndOldPods splits the attachment pods into the current one, whose
// volumes are exactly names, and the old ones, newest first (v1.7.0
// volume-hotplug.go:52 getActiveAndOldAttachmentPods). A matching pod that
// is being deleted is current up to v1.7.0 and neither current nor old
// from PR 16159 on (v1.8.2 volume-hotplug.go:59).
func activeAndOldPods(f features, names []string, pods []*corev1.Pod) (current *corev1.Pod, old []*corev1.Pod) {
	for _, p := range pods {
		switch {
		case !sameSet(podVolumes(p), names):
			old = append(old, p)
		case p.DeletionTimestamp == nil || f.terminatingPodIsCurrent:
			current = p
		}
	}
	sortNewestFirst(old)
	return current, old
}

// needsHandleHotplug: with exactly one attachment pod holding the whole
// set, virt-controller does not look at pods at all (v1.7.0
// volume-hotplug.go:41).
func needsHandleHotplug(names []string, pods []*corev1.Pod) bool {
	if len(pods) > 1 {
		return true
	}
	if len(pods) == 1 && sameSet(podVolumes(pods[0]), names) {
		return false
	}
	return len(names) > 0 || len(pods) > 0
}

// hasPendingPods: no new attachment pod while an old one has not reached
// Running, Succeeded or Failed, deleted or not (v1.7.0
// volume-hotplug.go:379).
func hasPendingPods(pods []*corev1.Pod) bool {
	return slices.ContainsFunc(pods, func(p *corev1.Pod) bool {
		switch p.Status.Phase {
		case corev1.PodRunning, corev1.PodSucceeded, corev1.PodFailed:
			return false
		}
		return true
	})
}

// podHolding is the first pod holding volume (v1.7.0 volume-hotplug.go:232
// findAttachmentPodByVolumeName).
func podHolding(volume string, pods []*corev1.Pod) *corev1.Pod {
	for _, p := range pods {
		if slices.Contains(podVolumes(p), volume) {
			return p
		}
	}
	return nil
}

// oldPodsToDelete is virt-controller's cleanupAttachmentPods (v1.7.0
// volume-hotplug.go:74; v1.5.3 vmi.go:1695; main volume-hotplug.go:77):
// while the current pod is not running, the newest running old pod is kept
// (on main only if it still holds a volume worth keeping); from v1.6 on, an
// old pod is kept while it holds a removed volume still Ready or
// MountedToPod; every other old pod, pending ones included, is deleted.
func oldPodsToDelete(f features, vmi *kubevirtv1.VirtualMachineInstance, current *corev1.Pod, old []*corev1.Pod, numReady int) []*corev1.Pod {
	removed := map[string]kubevirtv1.VolumeStatus{}
	for _, e := range vmi.Status.VolumeStatus {
		if e.HotplugVolume != nil && !HasVolume(vmi.Spec.Volumes, e.Name) {
			removed[e.Name] = e
		}
	}
	inSpec := map[string]bool{}
	for _, v := range vmi.Spec.Volumes {
		if isHotpluggable(v) {
			inSpec[v.Name] = true
		}
	}
	stillMounted := func(p *corev1.Pod) bool {
		return slices.ContainsFunc(podVolumes(p), func(name string) bool {
			e, ok := removed[name]
			return ok && (e.Phase == kubevirtv1.VolumeReady || e.Phase == kubevirtv1.HotplugVolumeMounted)
		})
	}
	worthKeeping := func(p *corev1.Pod) bool { // main volume-hotplug.go:144
		return !f.keepOldPodOnlyIfUseful || stillMounted(p) ||
			slices.ContainsFunc(podVolumes(p), func(name string) bool { return inSpec[name] })
	}
	currentNotRunning := current == nil || current.Status.Phase != corev1.PodRunning
	keptRunning := false
	var out []*corev1.Pod
	for _, p := range old {
		if !keptRunning && p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil &&
			numReady > 0 && currentNotRunning && worthKeeping(p) {
			keptRunning = true
			continue
		}
		if f.keepMountedOnUnplug && stillMounted(p) {
			continue
		}
		if p.DeletionTimestamp == nil {
			out = append(out, p)
		}
	}
	return out
}

func hotNames(hot []hotVolume) []string {
	names := make([]string, len(hot))
	for i, h := range hot {
		names[i] = h.name
	}
	return names
}

func podVolumes(p *corev1.Pod) []string {
	var names []string
	_ = json.Unmarshal([]byte(p.Annotations[annotationAttachmentPodVolumes]), &names)
	return names
}

// containerReady is KubeVirt's test for handing a pod's UID to virt-handler
// (v1.7.0 storage.go:199): its one container is ready. Deletion does not
// matter.
func containerReady(p *corev1.Pod) bool {
	return len(p.Status.ContainerStatuses) == 1 && p.Status.ContainerStatuses[0].Ready
}

func sameSet(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	x, y := slices.Clone(a), slices.Clone(b)
	slices.Sort(x)
	slices.Sort(y)
	return slices.Equal(x, y)
}

func sortNewestFirst(pods []*corev1.Pod) {
	sort.SliceStable(pods, func(i, j int) bool {
		if !pods[i].CreationTimestamp.Equal(&pods[j].CreationTimestamp) {
			return pods[i].CreationTimestamp.After(pods[j].CreationTimestamp.Time)
		}
		return pods[i].Name > pods[j].Name
	})
}

func sortEntries(e []kubevirtv1.VolumeStatus) {
	sort.SliceStable(e, func(i, j int) bool { return e[i].Name < e[j].Name })
}

func pvcInfo(pvc *corev1.PersistentVolumeClaim) *kubevirtv1.PersistentVolumeClaimInfo {
	return &kubevirtv1.PersistentVolumeClaimInfo{
		ClaimName:   pvc.Name,
		AccessModes: pvc.Spec.AccessModes,
		VolumeMode:  pvc.Spec.VolumeMode,
		Capacity:    pvc.Status.Capacity,
		Requests:    pvc.Spec.Resources.Requests,
	}
}

// nextTarget picks the first free sdX (vdX for virtio) name.
func nextTarget(d *kubevirtv1.Disk, used map[string]bool) string {
	prefix := "sd"
	if d != nil && diskBus(d) == kubevirtv1.DiskBusVirtio {
		prefix = "vd"
	}
	return virthandler.FreeTarget(prefix, used)
}
