package kubevirtsim

import (
	"context"
	"fmt"
	"maps"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// With Options.Kubelets the simulator's pods are run by real kubelets on
// host nodes that a real scheduler fills, so they are written as KubeVirt
// writes them: a virt-launcher pod per VMI, which the scheduler places, and
// attachment pods that follow it there by node affinity.

// launcherImage is the image of the simulator's KubeVirt pods; a hollow
// kubelet runs a container of an image it has no command for until the
// pod is deleted, as virt-launcher's compute container runs the domain.
const launcherImage = "kubevirt/virt-launcher:simulated"

// valueLauncherPod is the kubevirt.io label of virt-launcher pods (v1.7.0
// pkg/virt-controller/services/template.go).
const valueLauncherPod = "virt-launcher"

// KubeVirt's devices a virt-launcher pod asks for, which virt-handler's
// device plugins advertise on the node (v1.7.0
// pkg/virt-controller/services/template.go:79-81).
var launcherDevices = []corev1.ResourceName{"devices.kubevirt.io/kvm", "devices.kubevirt.io/tun", "devices.kubevirt.io/vhost-net"}

// podSelector selects the pods the simulator watches: attachment pods, and
// with Kubelets virt-launcher pods too.
func (c *cluster) podSelector() string {
	if c.opts.Kubelets {
		return labelAttachmentPod + " in (" + valueAttachmentPod + "," + valueLauncherPod + ")"
	}
	return labelAttachmentPod + "=" + valueAttachmentPod
}

// launcherPods are the VMI's virt-launcher pods in the cache: the ones
// created for this VMI, not for an earlier one of the same name; during a
// live migration the source's and the target's.
func (c *cluster) launcherPods(vmi *kubevirtv1.VirtualMachineInstance) []*corev1.Pod {
	pods, _ := c.podLister.Pods(vmi.Namespace).List(labels.SelectorFromSet(labels.Set{
		labelAttachmentPod: valueLauncherPod, kubevirtv1.CreatedByLabel: string(vmi.UID),
	}))
	return pods
}

// launcherPod is the VMI's current virt-launcher pod from the cache (nil if
// none): the one on status.nodeName, as KubeVirt's CurrentVMIPod takes it
// (v1.7.0 pkg/controller/controller.go:321-357), so that a migration's
// target pod becomes the VMI's only at the hand-off; before the VMI has a
// node, the one no migration created.
func (c *cluster) launcherPod(vmi *kubevirtv1.VirtualMachineInstance) *corev1.Pod {
	pods := c.launcherPods(vmi)
	sortNewestFirst(pods)
	for _, p := range pods {
		if vmi.Status.NodeName != "" && p.Spec.NodeName == vmi.Status.NodeName {
			return p
		}
		if vmi.Status.NodeName == "" && p.Labels[kubevirtv1.MigrationJobLabel] == "" {
			return p
		}
	}
	return nil
}

// ownedByLauncherOf reports whether p's controller is the VMI's
// virt-launcher pod, as KubeVirt owns attachment pods (v1.7.0
// pkg/virt-controller/services/template.go:964-970).
func (c *cluster) ownedByLauncherOf(p *corev1.Pod, vmi *kubevirtv1.VirtualMachineInstance) bool {
	ref := metav1.GetControllerOf(p)
	if ref == nil || ref.Kind != "Pod" {
		return false
	}
	l := c.launcherPod(vmi)
	return l != nil && l.UID == ref.UID
}

// launcherName is deterministic, so that a pass that retries after a failed
// status write finds the pod it created instead of creating another.
func launcherName(vmi *kubevirtv1.VirtualMachineInstance) string {
	uid := string(vmi.UID)
	if len(uid) > 5 {
		uid = uid[:5]
	}
	return "virt-launcher-" + vmi.Name + "-" + uid
}

// ensureLauncher creates the VMI's virt-launcher pod if the cache has none.
func (v *vmiController) ensureLauncher(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance) error {
	if v.c.launcherPod(vmi) != nil {
		return nil
	}
	pod := launcherManifest(vmi)
	_, err := v.c.kube.CoreV1().Pods(vmi.Namespace).Create(ctx, pod, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("virt-launcher pod: %w", err)
	}
	v.c.log.V(2).Info("virt-launcher pod created", "vm", vmi.Namespace+"/"+vmi.Name, "pod", pod.Name)
	return nil
}

// launcherManifest is the VMI's virt-launcher pod as RenderLaunchManifest
// writes it (v1.7.0 pkg/virt-controller/services/template.go), the parts
// the scheduler and the kubelet act on: the VMI's node selector (with the
// node labeller's schedulable label), affinity and tolerations, memory
// request and KubeVirt's devices, so the scheduler places it as it places
// KubeVirt's own.
func launcherManifest(vmi *kubevirtv1.VirtualMachineInstance) *corev1.Pod {
	lbl := maps.Clone(vmi.Labels)
	if lbl == nil {
		lbl = map[string]string{}
	}
	lbl[labelAttachmentPod] = valueLauncherPod
	lbl[kubevirtv1.CreatedByLabel] = string(vmi.UID)
	lbl[labelAttachmentPodVMI] = vmi.Name // the VMI's pod events requeue it
	sel := maps.Clone(vmi.Spec.NodeSelector)
	if sel == nil {
		sel = map[string]string{}
	}
	sel[kubevirtv1.NodeSchedulable] = "true"
	res := corev1.ResourceRequirements{Requests: corev1.ResourceList{}, Limits: corev1.ResourceList{}}
	if m, ok := vmi.Spec.Domain.Resources.Requests[corev1.ResourceMemory]; ok {
		res.Requests[corev1.ResourceMemory] = m
	}
	for _, d := range launcherDevices {
		res.Limits[d] = resource.MustParse("1")
	}
	grace := kubevirtv1.DefaultGracePeriodSeconds
	if g := vmi.Spec.TerminationGracePeriodSeconds; g != nil {
		grace = *g
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: launcherName(vmi), Namespace: vmi.Namespace, Labels: lbl, Annotations: map[string]string{},
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: kubevirtv1.GroupVersion.String(), Kind: "VirtualMachineInstance", Name: vmi.Name, UID: vmi.UID,
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true),
			}},
		},
		Spec: corev1.PodSpec{
			NodeSelector: sel, Affinity: vmi.Spec.Affinity.DeepCopy(), Tolerations: vmi.Spec.Tolerations,
			TerminationGracePeriodSeconds: ptr.To(grace),
			Containers: []corev1.Container{{
				Name: "compute", Image: launcherImage, Command: []string{"/usr/bin/virt-launcher-monitor"}, Resources: res,
			}},
		},
	}
	return pod
}

// launcherRunning is the launcher pod once the scheduler placed it and its
// kubelet runs it, else nil.
func (c *cluster) launcherRunning(vmi *kubevirtv1.VirtualMachineInstance) *corev1.Pod {
	l := c.launcherPod(vmi)
	if l == nil || l.Spec.NodeName == "" || l.Status.Phase != corev1.PodRunning {
		return nil
	}
	return l
}

// kubeletAttachmentPod turns the simulator's attachment pod into the one
// KubeVirt renders for a real kubelet (v1.7.0
// pkg/virt-controller/services/template.go:952-1077, v1.5.3 :909-1030): no
// node name but a required node affinity to the launcher's node and the
// launcher's tolerations, owned by the launcher pod, grace period 0, the
// hotplug container's requests and limits (renderresources.go:736-772),
// and each claim volume named after the VMI's volume, a block claim given
// to the container as a device and a filesystem one mounted (unless its
// volume is already in the domain).
func kubeletAttachmentPod(pod *corev1.Pod, vmi *kubevirtv1.VirtualMachineInstance, hot []hotVolume, launcher *corev1.Pod) {
	pod.OwnerReferences = []metav1.OwnerReference{{
		APIVersion: "v1", Kind: "Pod", Name: launcher.Name, UID: launcher.UID,
		Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true),
	}}
	pod.Spec.NodeName = ""
	pod.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{
		RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
			MatchExpressions: []corev1.NodeSelectorRequirement{{
				Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpIn, Values: []string{launcher.Spec.NodeName},
			}},
		}}},
	}}
	pod.Spec.Tolerations = launcher.Spec.Tolerations
	pod.Spec.TerminationGracePeriodSeconds = ptr.To[int64](0)
	c := &pod.Spec.Containers[0]
	c.Image = launcherImage
	c.Resources = corev1.ResourceRequirements{
		Limits:   corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("80M")},
		Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("10m"), corev1.ResourceMemory: resource.MustParse("2M")},
	}
	c.VolumeMounts = []corev1.VolumeMount{{Name: "hotplug-disks", MountPath: "/path"}}
	pod.Spec.Volumes = []corev1.Volume{{Name: "hotplug-disks", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}}}
	phase := map[string]kubevirtv1.VolumePhase{}
	for _, e := range vmi.Status.VolumeStatus {
		phase[e.Name] = e.Phase
	}
	for _, h := range hot {
		pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{
			Name:         h.name,
			VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: h.claim}},
		})
		switch {
		case h.pvc != nil && h.pvc.Spec.VolumeMode != nil && *h.pvc.Spec.VolumeMode == corev1.PersistentVolumeBlock:
			c.VolumeDevices = append(c.VolumeDevices, corev1.VolumeDevice{Name: h.name, DevicePath: fmt.Sprintf("/path/%s/%s", h.name, h.pvc.UID)})
		case phase[h.name] != kubevirtv1.VolumeReady && phase[h.name] != kubevirtv1.HotplugVolumeMounted:
			c.VolumeMounts = append(c.VolumeMounts, corev1.VolumeMount{Name: h.name, MountPath: "/" + h.name})
		}
	}
}

// deleteLauncher deletes the VMI's virt-launcher pods once its domain is
// down: with the domain gone, its compute container ends; a migration
// target's goes with it.
func deleteLauncher(ctx context.Context, c *cluster, vmi *kubevirtv1.VirtualMachineInstance) error {
	for _, l := range c.launcherPods(vmi) {
		if l.DeletionTimestamp == nil {
			if err := deleteAttachmentPod(ctx, c, l); err != nil {
				return err
			}
		}
	}
	return nil
}
