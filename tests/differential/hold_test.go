package differential

import (
	"context"
	"fmt"
	"strings"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// A hold keeps one step of the node agents from happening, so that a
// scenario can act in the state before it for as long as it needs, with no
// timing: a ValidatingAdmissionPolicy refuses the write that would report
// the step, and both hosts' agents (the simulator's and the stand-ins beside
// KubeVirt's real control plane) retry a refused write.
type hold struct {
	name     string
	message  string
	resource admissionv1.Rule
	labels   *metav1.LabelSelector           // nil: every object
	refuse   string                          // CEL: true when the write must be refused
	probe    func(ctx context.Context) error // a dry-run write the hold refuses
}

// podStartHold keeps attachment pods starting: the kubelet's pods/status
// write that reports one Running is refused.
func podStartHold(kube kubernetes.Interface, ns string) hold {
	const probeLabel, probeName = "differential-hold-probe", "differential-hold-probe"
	pods := kube.CoreV1().Pods(ns)
	return hold{
		name:     "differential-hold-pod-start",
		message:  "attachment pods are held starting",
		resource: admissionv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"pods/status"}},
		labels: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{
			Key: kubevirtv1.AppLabel, Operator: metav1.LabelSelectorOpIn, Values: []string{"hotplug-disk", probeLabel},
		}}},
		refuse: "object.status.phase == 'Running'",
		// A pod with a label no kubelet watches.
		probe: func(ctx context.Context) error {
			p, err := pods.Get(ctx, probeName, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				p, err = pods.Create(ctx, &corev1.Pod{
					ObjectMeta: metav1.ObjectMeta{Name: probeName, Labels: map[string]string{kubevirtv1.AppLabel: probeLabel}},
					Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "probe", Image: "none"}}},
				}, metav1.CreateOptions{})
			}
			if err != nil {
				return fmt.Errorf("probe pod: %w", err)
			}
			p.Status.Phase = corev1.PodRunning
			_, err = pods.UpdateStatus(ctx, p, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}})
			return err
		},
	}
}

// unmountHold keeps volumes mounted: virt-handler's VMI write that reports
// an entry UnMountedFromPod is refused, so a removed volume's entry stays
// in the VMI's status after it left the VMI's spec.
func unmountHold(read, kv kubevirt.Interface, ns, vm string) hold {
	return hold{
		name:     "differential-hold-unmount",
		message:  "hot-plugged volumes are held mounted",
		resource: admissionv1.Rule{APIGroups: []string{"kubevirt.io"}, APIVersions: []string{"v1"}, Resources: []string{"virtualmachineinstances", "virtualmachineinstances/status"}},
		refuse:   "has(object.status) && has(object.status.volumeStatus) && object.status.volumeStatus.exists(v, has(v.phase) && v.phase == 'UnMountedFromPod')",
		// A dry-run write of vm's VMI reporting an unmount, as virt-handler
		// writes it (kv must act as virt-handler on KubeVirt's own control
		// plane): to the status subresource on the simulator's CRD, to the
		// object itself on KubeVirt's, which has none.
		probe: func(ctx context.Context) error {
			// virt-handler's role may not get a VMI: read as another.
			vmi, err := read.KubevirtV1().VirtualMachineInstances(ns).Get(ctx, vm, metav1.GetOptions{})
			if err != nil {
				return err
			}
			vmi.Status.VolumeStatus = append(vmi.Status.VolumeStatus, kubevirtv1.VolumeStatus{Name: "probe", Phase: kubevirtv1.HotplugVolumeUnMounted})
			put := func(sub ...string) error {
				return kv.KubevirtV1().RESTClient().Put().Namespace(ns).Resource("virtualmachineinstances").Name(vm).SubResource(sub...).
					Param("dryRun", metav1.DryRunAll).Body(vmi).Do(ctx).Error()
			}
			// KubeVirt's VMI has no status subresource, and its RBAC names
			// none: there the status write is refused before it is routed.
			if err := put("status"); !apierrors.IsNotFound(err) && !apierrors.IsForbidden(err) {
				return err
			}
			return put()
		},
	}
}

func (h hold) policy() *admissionv1.ValidatingAdmissionPolicy {
	return &admissionv1.ValidatingAdmissionPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: h.name},
		Spec: admissionv1.ValidatingAdmissionPolicySpec{
			FailurePolicy: ptr.To(admissionv1.Fail),
			MatchConstraints: &admissionv1.MatchResources{ResourceRules: []admissionv1.NamedRuleWithOperations{{
				RuleWithOperations: admissionv1.RuleWithOperations{
					Operations: []admissionv1.OperationType{admissionv1.Create, admissionv1.Update},
					Rule:       h.resource,
				},
			}}},
			Validations: []admissionv1.Validation{{Expression: "!(" + h.refuse + ")", Message: h.message}},
		},
	}
}

// on installs the policy and returns once the API server enforces it.
func (h hold) on(ctx context.Context, kube kubernetes.Interface) error {
	binding := &admissionv1.ValidatingAdmissionPolicyBinding{
		ObjectMeta: metav1.ObjectMeta{Name: h.name},
		Spec: admissionv1.ValidatingAdmissionPolicyBindingSpec{
			PolicyName:        h.name,
			ValidationActions: []admissionv1.ValidationAction{admissionv1.Deny},
			MatchResources:    &admissionv1.MatchResources{ObjectSelector: h.labels},
		},
	}
	adm := kube.AdmissionregistrationV1()
	if _, err := adm.ValidatingAdmissionPolicies().Create(ctx, h.policy(), metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("%s policy: %w", h.name, err)
	}
	if _, err := adm.ValidatingAdmissionPolicyBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("%s binding: %w", h.name, err)
	}
	return h.await(ctx, true)
}

// off removes the binding and returns once the write goes through again.
func (h hold) off(ctx context.Context, kube kubernetes.Interface) error {
	err := kube.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Delete(ctx, h.name, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("%s binding: %w", h.name, err)
	}
	return h.await(ctx, false)
}

// await dry-runs the probe until the API server answers as the hold says:
// a policy and its binding reach admission through informers, a moment
// after they are stored.
func (h hold) await(ctx context.Context, held bool) error {
	return testwait.Poll(ctx, fmt.Sprintf("%s %v", h.name, held), func() (bool, string, error) {
		err := h.probe(ctx)
		refused := err != nil && strings.Contains(err.Error(), h.message)
		if err == nil {
			return !held, "write allowed", nil
		}
		return refused == held, "write answered: " + err.Error(), nil
	})
}
