package differential

import (
	"context"
	"fmt"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// A hold keeps attachment pods from starting: a ValidatingAdmissionPolicy
// refuses every pods/status write that reports one Running. Both hosts'
// kubelets (the simulator's and the stand-in beside KubeVirt's real control
// plane) write that status and retry a refusal, so one mechanism holds the
// same state on both, for as long as a scenario needs, with no timing.
const (
	holdName   = "differential-hold-attachment-pods"
	probeLabel = "differential-hold-probe"
	probeName  = "differential-hold-probe"
)

type hold struct {
	kube kubernetes.Interface
	ns   string
}

// on installs the policy and returns once the API server enforces it.
func (h hold) on(ctx context.Context) error {
	policy := &admissionv1.ValidatingAdmissionPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: holdName},
		Spec: admissionv1.ValidatingAdmissionPolicySpec{
			FailurePolicy: ptr.To(admissionv1.Fail),
			MatchConstraints: &admissionv1.MatchResources{ResourceRules: []admissionv1.NamedRuleWithOperations{{
				RuleWithOperations: admissionv1.RuleWithOperations{
					Operations: []admissionv1.OperationType{admissionv1.Update},
					Rule:       admissionv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"pods/status"}},
				},
			}}},
			Validations: []admissionv1.Validation{{
				Expression: "object.status.phase != 'Running'",
				Message:    "attachment pods are held starting",
			}},
		},
	}
	binding := &admissionv1.ValidatingAdmissionPolicyBinding{
		ObjectMeta: metav1.ObjectMeta{Name: holdName},
		Spec: admissionv1.ValidatingAdmissionPolicyBindingSpec{
			PolicyName:        holdName,
			ValidationActions: []admissionv1.ValidationAction{admissionv1.Deny},
			MatchResources: &admissionv1.MatchResources{ObjectSelector: &metav1.LabelSelector{
				MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "kubevirt.io", Operator: metav1.LabelSelectorOpIn, Values: []string{"hotplug-disk", probeLabel}}},
			}},
		},
	}
	adm := h.kube.AdmissionregistrationV1()
	if _, err := adm.ValidatingAdmissionPolicies().Create(ctx, policy, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("hold policy: %w", err)
	}
	if _, err := adm.ValidatingAdmissionPolicyBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("hold binding: %w", err)
	}
	return h.await(ctx, true)
}

// off removes the binding and returns once pods may start again.
func (h hold) off(ctx context.Context) error {
	err := h.kube.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Delete(ctx, holdName, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("hold binding: %w", err)
	}
	return h.await(ctx, false)
}

// await dry-runs a Running status on a probe pod (a label no kubelet
// watches) until the API server answers as the hold says: the policy and
// binding reach admission through informers, a moment after they are stored.
func (h hold) await(ctx context.Context, held bool) error {
	pods := h.kube.CoreV1().Pods(h.ns)
	return testwait.Poll(ctx, fmt.Sprintf("attachment-pod hold %v", held), func() (bool, string, error) {
		p, err := pods.Get(ctx, probeName, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			p, err = pods.Create(ctx, &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: probeName, Labels: map[string]string{"kubevirt.io": probeLabel}},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "probe", Image: "none"}}},
			}, metav1.CreateOptions{})
		}
		if err != nil {
			return false, "probe pod: " + err.Error(), nil
		}
		p.Status.Phase = corev1.PodRunning
		_, err = pods.UpdateStatus(ctx, p, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}})
		switch {
		case err == nil:
			return !held, "status write allowed", nil
		case apierrors.IsInvalid(err) || apierrors.IsForbidden(err):
			return held, "status write refused: " + err.Error(), nil
		default:
			return false, err.Error(), nil
		}
	})
}
